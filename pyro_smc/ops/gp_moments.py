r"""Squared-exponential ARD Gaussian-process posteriors: predictions, linearisation and exact
moments at Gaussian inputs (Deisenroth's GP-ADF / PILCO equations).

There are ``E`` independent GPs, one per output ``a``, sharing the training inputs ``X`` (``n, D``):
:math:`k_a(x, x') = \alpha_a^2 \exp(-\tfrac12 (x - x')^\top \Lambda_a^{-1} (x - x'))` with :math:`\Lambda_a = \operatorname{diag}(l_a^2)`,
:math:`\beta_a = (K_a + \sigma_a^2 I)^{-1} y_a` and ``gram_inv[a]`` :math:`= (K_a + \sigma_a^2 I)^{-1}`. The latent
posterior at ``x`` has mean :math:`m_a(x) = k_a(X, x)^\top \beta_a` and variance
:math:`v_a(x) = \alpha_a^2 - k_a(X, x)^\top (K_a + \sigma_a^2 I)^{-1} k_a(X, x)`.

For :math:`x \sim \mathcal N(\mu, S)` and :math:`h_a = f_a(x)`, :func:`se_ard_moments` returns ``E[h]``, ``Cov[h]`` and
``Cov[x, h]`` in closed form, with :math:`\nu_i = x_i - \mu`:

.. math::

    M_a = \beta_a^T q_a,

    q_{ai} = \alpha_a^2 |S\Lambda_a^{-1} + I|^{-1/2} \exp(-\tfrac12 \nu_i^T (S + \Lambda_a)^{-1} \nu_i),

    \mathrm{Cov}[x, h_a] = S (S + \Lambda_a)^{-1} \textstyle\sum_i \beta_{ai} q_{ai} \nu_i,

    \mathrm{Cov}[h]_{ab} = \beta_a^T Q^{ab} \beta_b - M_a M_b
        + \delta_{ab} (\alpha_a^2 - \mathrm{tr}((K_a + \sigma_a^2 I)^{-1} Q^{aa})),

    Q^{ab}_{ij} = k_a(x_i, \mu) k_b(x_j, \mu) |R|^{-1/2} \exp(\tfrac12 z_{ij}^T R^{-1} S z_{ij}),

    R = S(\Lambda_a^{-1} + \Lambda_b^{-1}) + I, \qquad z_{ij} = \Lambda_a^{-1}\nu_i + \Lambda_b^{-1}\nu_j.

With :math:`W = \Lambda_a^{-1} + \Lambda_b^{-1}` and :math:`B = W^{1/2} S W^{1/2}`, :math:`R^{-1} S = W^{-1/2} (I - (I + B)^{-1}) W^{-1/2}`
and :math:`|R| = |I + B|`: one Cholesky of a matrix with eigenvalues >= 1, no inverse of ``S``. The exponent
:math:`\log Q^{ab}_{ij}` is :math:`u_i + v_j + (R^{-1} S \Lambda_a^{-1} \nu_i)^\top \Lambda_b^{-1} \nu_j`, an ``n x (D+2)`` by
``(D+2) x n`` product, so each unordered pair ``a <= b`` costs one ``n x n`` exponential and one
mat-vec with ``beta_b``. Pairs run one at a time (the block stays in cache) after their small
factors are built in batches; memory stays below ``chunk_size`` elements per temporary. The
``E (E + 1) / 2`` exponentials dominate (about 0.26 G of them at ``E = 56``, ``n = 403``). Since
:math:`Q^{ab} / (\alpha_a^2 \alpha_b^2)` depends only on ``(l_a, l_b)``, outputs with equal lengthscales are
grouped: a pair of groups costs one exponential, so a shared lengthscale costs one in all (unless
the lengthscales require grad: each output then needs its own terms for its own gradient).

See ``docs/math/ep.md#exact-moments-of-a-gp-at-a-gaussian-input`` and ``docs/math/ep.md#gp-regression-with-se-ard-kernels``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.gp_moments import se_ard_kernel, se_ard_moments, se_ard_predict
    >>> X = torch.randn(20, 2, dtype=torch.float64)
    >>> Y = torch.sin(X) + 0.1 * torch.randn(20, 2, dtype=torch.float64)
    >>> ell, var, noise = (
    ...     torch.ones(2, 2, dtype=torch.float64),
    ...     torch.ones(2, dtype=torch.float64),
    ...     torch.full((2,), 0.01, dtype=torch.float64),
    ... )
    >>> gram = se_ard_kernel(X, X, ell, var) + noise[:, None, None] * torch.eye(
    ...     20, dtype=torch.float64
    ... )
    >>> gram_inv = torch.cholesky_inverse(torch.linalg.cholesky(gram))
    >>> beta = (gram_inv @ Y.T.unsqueeze(-1)).squeeze(-1)
    >>> mu, S = (
    ...     torch.zeros(2, dtype=torch.float64),
    ...     1e-14 * torch.eye(2, dtype=torch.float64),
    ... )
    >>> M, V, C = se_ard_moments(mu, S, X, beta, gram_inv, ell, var)
    >>> m, v = se_ard_predict(mu, X, beta, gram_inv, ell, var)
    >>> torch.allclose(M, m) and torch.allclose(V.diagonal(), v, atol=1e-10)
    True

References:
    Deisenroth, Huber, Hanebeck (2009). Analytic moment-based Gaussian process filtering.
    Deisenroth and Rasmussen (2011). PILCO: a model-based and data-efficient approach to policy search.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["DEFAULT_CHUNK_SIZE", "se_ard_kernel", "se_ard_predict", "se_ard_linearize", "se_ard_moments"]

#: Elements per temporary block (64 MiB in float64).
DEFAULT_CHUNK_SIZE = 2**23

_LOG2E = 1.0 / math.log(2.0)


def se_ard_kernel(x1: Tensor, x2: Tensor, lengthscale: Tensor, variance: Tensor) -> Tensor:
    r"""SE-ARD cross-covariances of ``E`` kernels.

    Args:
        x1: ``(..., m, D)`` inputs.
        x2: ``(n, D)`` inputs.
        lengthscale: ``(E, D)`` positive lengthscales ``l_a``.
        variance: ``(E,)`` signal variances :math:`\alpha_a^2`.

    Returns:
        ``(..., E, m, n)`` tensor :math:`\alpha_a^2 \exp(-\tfrac12 \sum_d (x_{1d} - x_{2d})^2 / l_{ad}^2)` (``x1``, ``x2`` the two inputs).

    Example:
        >>> ell = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
        >>> k = se_ard_kernel(
        ...     torch.zeros(3, 2), torch.ones(4, 2), ell, torch.tensor([2.0, 1.0])
        ... )
        >>> k.shape, round(float(k[0, 0, 0]), 4), round(float(k[1, 0, 0]), 4)  # 2 e^-1, e^-1/4
        (torch.Size([2, 3, 4]), 0.7358, 0.7788)
    """
    # Centring at the data mean keeps the norms in |a|^2 + |b|^2 - 2 a.b small (less cancellation).
    center = x2.mean(-2)
    a = (x1 - center).unsqueeze(-3) / lengthscale.unsqueeze(-2)
    b = (x2 - center) / lengthscale.unsqueeze(-2)
    r2 = (a * a).sum(-1, keepdim=True) + (b * b).sum(-1).unsqueeze(-2) - 2 * a @ b.transpose(-1, -2)
    return variance[:, None, None] * torch.exp(-0.5 * r2.clamp_min(0))


def _points(x: Tensor, E: int, n: int, chunk_size: int | None):
    # Flattened points and the chunks of them whose (E, m, n) kernel block fits in chunk_size.
    flat = x.reshape(-1, x.shape[-1])
    step = max(1, (chunk_size or DEFAULT_CHUNK_SIZE) // (2 * E * n))
    return flat, [flat[i : i + step] for i in range(0, flat.shape[0], step)]


def _latent_variance(k: Tensor, gram_inv: Tensor, variance: Tensor) -> Tensor:
    # alpha^2 - k^T (K + sigma^2 I)^{-1} k is non-negative in exact arithmetic; clamp rounding.
    return (variance[:, None] - ((k @ gram_inv) * k).sum(-1)).clamp_min(0)


def se_ard_predict(
    x: Tensor,
    X: Tensor,
    beta: Tensor,
    gram_inv: Tensor,
    lengthscale: Tensor,
    variance: Tensor,
    noise: Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Posterior mean and variance of ``E`` SE-ARD GPs at deterministic inputs.

    Args:
        x: ``(..., D)`` test inputs.
        X: ``(n, D)`` training inputs.
        beta: ``(E, n)`` weights :math:`(K_a + \sigma_a^2 I)^{-1} y_a`.
        gram_inv: ``(E, n, n)`` inverses :math:`(K_a + \sigma_a^2 I)^{-1}`.
        lengthscale: ``(E, D)``.
        variance: ``(E,)`` signal variances :math:`\alpha_a^2`.
        noise: ``(E,)`` likelihood variances :math:`\sigma_a^2`, added to the variance when given.
        chunk_size: elements per temporary block (default :data:`DEFAULT_CHUNK_SIZE`).

    Returns:
        ``(mean, var)``, each ``(..., E)``: latent mean and variance (plus ``noise`` if given).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> # n = 5, D = 1, E = 1
        >>> X, y = torch.linspace(-2, 2, 5).unsqueeze(-1), torch.randn(1, 5)
        >>> ell, var = torch.ones(1, 1), torch.ones(1)
        >>> gram_inv = torch.linalg.inv(se_ard_kernel(X, X, ell, var) + 0.01 * torch.eye(5))
        >>> beta = (gram_inv @ y.unsqueeze(-1)).squeeze(-1)
        >>> mean, v = se_ard_predict(X, X, beta, gram_inv, ell, var)  # at the training inputs
        >>> mean.shape, bool(torch.allclose(mean.T, y, atol=0.1)), bool((v < 0.02).all())
        (torch.Size([5, 1]), True, True)
    """
    E, n = beta.shape
    _, chunks = _points(x, E, n, chunk_size)
    means, variances = [], []
    for xc in chunks:
        k = se_ard_kernel(xc, X, lengthscale, variance)  # (E, m, n)
        means.append((k @ beta.unsqueeze(-1)).squeeze(-1))
        variances.append(_latent_variance(k, gram_inv, variance))
    mean = torch.cat(means, -1).T.reshape(x.shape[:-1] + (E,))
    var = torch.cat(variances, -1).T.reshape(x.shape[:-1] + (E,))
    if noise is not None:
        var = var + noise
    return mean, var


def se_ard_linearize(
    x: Tensor,
    X: Tensor,
    beta: Tensor,
    gram_inv: Tensor,
    lengthscale: Tensor,
    variance: Tensor,
    noise: Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Posterior mean, its Jacobian and the variance at ``x`` (the GP-EKS linearisation).

    :math:`\partial m_a / \partial x = \sum_i \beta_{ai} k_a(x_i, x) \Lambda_a^{-1} (x_i - x)`.
    See ``docs/math/ep.md#gp-regression-with-se-ard-kernels``.

    Args:
        x: ``(..., D)`` linearisation points; other arguments as :func:`se_ard_predict`.

    Returns:
        ``(mean (..., E), jacobian (..., E, D), var (..., E))``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> # n = 5, D = 1, E = 1
        >>> X, y = torch.linspace(-2, 2, 5).unsqueeze(-1), torch.randn(1, 5)
        >>> ell, var = torch.ones(1, 1), torch.ones(1)
        >>> gram_inv = torch.linalg.inv(se_ard_kernel(X, X, ell, var) + 0.01 * torch.eye(5))
        >>> beta = (gram_inv @ y.unsqueeze(-1)).squeeze(-1)
        >>> x = torch.tensor([[0.3]], requires_grad=True)
        >>> mean, jac, v = se_ard_linearize(x.detach(), X, beta, gram_inv, ell, var)
        >>> (grad,) = torch.autograd.grad(
        ...     se_ard_predict(x, X, beta, gram_inv, ell, var)[0].sum(), x
        ... )
        >>> jac.shape, bool(torch.allclose(jac.squeeze(-2), grad, atol=1e-4))
        (torch.Size([1, 1, 1]), True)
    """
    E, n = beta.shape
    D = X.shape[-1]
    _, chunks = _points(x, E, n, chunk_size)
    center = X.mean(0)
    Xc = X - center
    means, jacs, variances = [], [], []
    for xc in chunks:
        k = se_ard_kernel(xc, X, lengthscale, variance)  # (E, m, n)
        bk = k * beta.unsqueeze(-2)
        m = bk.sum(-1)
        means.append(m)
        jacs.append((bk @ Xc - m.unsqueeze(-1) * (xc - center)) / lengthscale.unsqueeze(-2).square())
        variances.append(_latent_variance(k, gram_inv, variance))
    batch = x.shape[:-1]
    mean = torch.cat(means, -1).T.reshape(batch + (E,))
    jac = torch.cat(jacs, -2).transpose(0, 1).reshape(batch + (E, D))
    var = torch.cat(variances, -1).T.reshape(batch + (E,))
    if noise is not None:
        var = var + noise
    return mean, jac, var


def _mean_and_cross_cov(nu: Tensor, S: Tensor, beta: Tensor, lengthscale: Tensor, variance: Tensor) -> tuple[Tensor, Tensor]:
    # nu (B, n, D), S (B, D, D) -> M (B, E), Cov[x, h] (B, D, E).
    # S + Lambda_a = Lambda_a^{1/2} L L^T Lambda_a^{1/2} with L L^T = Lambda_a^{-1/2} S Lambda_a^{-1/2} + I.
    D = S.shape[-1]
    eye = torch.eye(D, dtype=S.dtype, device=S.device)
    scaled = S.unsqueeze(1) / (lengthscale.unsqueeze(-1) * lengthscale.unsqueeze(-2)) + eye
    L = torch.linalg.cholesky(scaled)  # (B, E, D, D)
    y = torch.linalg.solve_triangular(L, (nu.unsqueeze(1) / lengthscale.unsqueeze(-2)).transpose(-1, -2), upper=False)
    log_det_half = torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)  # (B, E)
    log_q = variance.log().unsqueeze(-1) - log_det_half.unsqueeze(-1) - 0.5 * (y * y).sum(-2)
    bq = beta * log_q.exp()  # (B, E, n)
    M = bq.sum(-1)
    w = torch.linalg.solve_triangular(L.transpose(-1, -2), y @ bq.unsqueeze(-1), upper=True).squeeze(-1)
    cross = (S.unsqueeze(1) @ (w / lengthscale).unsqueeze(-1)).squeeze(-1)  # (B, E, D)
    return M, cross.transpose(-1, -2)


def _pair_exponents(S: Tensor, inv_l2: Tensor, log_var: Tensor, ia: Tensor, ib: Tensor) -> tuple[Tensor, Tensor]:
    # R^{-1} S (P, D, D) and log(alpha_a^2 alpha_b^2 |R|^{-1/2}) (P,) for one input covariance S (D, D).
    D = S.shape[-1]
    eye = torch.eye(D, dtype=S.dtype, device=S.device)
    sw = (inv_l2[ia] + inv_l2[ib]).sqrt()  # W^{1/2}
    outer = sw.unsqueeze(-1) * sw.unsqueeze(-2)
    L = torch.linalg.cholesky(S * outer + eye)  # I + B, eigenvalues >= 1
    T = (eye - torch.cholesky_inverse(L)) / outer
    return T, log_var[ia] + log_var[ib] - torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)


def _second_moments(
    nu: Tensor, S: Tensor, beta: Tensor, gram_inv: Tensor, lengthscale: Tensor, variance: Tensor, chunk_size: int
) -> Tensor:
    # F_ab = beta_a^T Q^{ab} beta_b - delta_ab tr(gram_inv_a Q^{aa}), shape (B, E, E).
    # Q^{ab} = alpha_a^2 alpha_b^2 Q(l_a, l_b): outputs with equal lengthscales form a group, and a
    # pair of groups costs one n x n exponential whatever the number of outputs in them.
    B, n, D = nu.shape
    if torch.is_grad_enabled() and lengthscale.requires_grad:
        # Each output its own group: a group's Q is built from its first member's lengthscale, so
        # the gradient of every member's terms would reach that member alone (d V_bb / d l_b came
        # out 0.78 where the truth is 0.0047, the two outputs' gradients swapped and summed).
        group = torch.arange(lengthscale.shape[0], device=lengthscale.device)
    else:
        _, group = torch.unique(lengthscale.detach(), dim=0, return_inverse=True)
    members = [torch.nonzero(group == g).squeeze(-1) for g in range(int(group.max()) + 1)]
    ells = lengthscale[torch.stack([m[0] for m in members])]  # indexing keeps gradients
    weights = [beta[m] * variance[m].unsqueeze(-1) for m in members]  # alpha_a^2 beta_a
    weights_t = [w.T.contiguous() for w in weights]
    gi, gj = torch.triu_indices(len(members), len(members), device=nu.device)
    pairs = list(zip(gi.tolist(), gj.tolist()))
    ids = [m.tolist() for m in members]
    rows_idx = [a for g, h in pairs for a in ids[g] for _ in ids[h]]
    cols_idx = [b for g, h in pairs for _ in ids[g] for b in ids[h]]
    inv_l2 = ells.pow(-2)
    # Factor blocks of up to 64 pairs stay in cache; the n x n block of one pair is the big temporary.
    step = min(64, max(1, chunk_size // (n * (4 * D + 6))))
    rows = n if n * n <= chunk_size else max(1, chunk_size // n)
    values = []
    for batch in range(B):
        T, log_c = _pair_exponents(S[batch], inv_l2, torch.zeros_like(inv_l2[:, 0]), gi, gj)
        z = nu[batch] * inv_l2.unsqueeze(-2)  # Lambda_a^{-1} nu_i, (G, n, D)
        half_sq = 0.5 * (z * nu[batch]).sum(-1)  # log k_a(x_i, mu) = log alpha_a^2 - half_sq
        for s in range(0, len(pairs), step):
            a, b = gi[s : s + step], gj[s : s + step]
            za, zb = z[a], z[b]
            Ta, Tb = za @ T[s : s + step], zb @ T[s : s + step]
            u = 0.5 * (za * Ta).sum(-1) - half_sq[a] + log_c[s : s + step].unsqueeze(-1)
            v = 0.5 * (zb * Tb).sum(-1) - half_sq[b]
            ones = torch.ones_like(u).unsqueeze(-1)
            # exp(x) = 2^(x log2 e): exp2 is the cheaper kernel and the scaling rides on the small factor.
            left = torch.cat([Ta, u.unsqueeze(-1), ones], -1) * _LOG2E
            right = torch.cat([zb, ones, v.unsqueeze(-1)], -1).transpose(-1, -2).contiguous()
            for j, (g, h) in enumerate(pairs[s : s + step]):
                block = 0.0
                for r0 in range(0, n, rows):
                    Q = torch.mm(left[j, r0 : r0 + rows], right[j]).exp2_()  # Q(l_g, l_h), rows r0:
                    block = block + weights[g][:, r0 : r0 + rows] @ (Q @ weights_t[h])
                    if g == h:
                        traces = [torch.dot(Q.reshape(-1), gram_inv[i, r0 : r0 + rows].reshape(-1)) for i in ids[g]]
                        block = block - torch.diag(torch.stack(traces) * variance[members[g]].square())
                if g == h and len(ids[g]) > 1:
                    block = (block + block.T) / 2
                values.append(block.reshape(-1))
    values = torch.cat(values)
    r = torch.tensor(rows_idx, device=nu.device).repeat(B)
    c = torch.tensor(cols_idx, device=nu.device).repeat(B)
    bi = torch.arange(B, device=nu.device).repeat_interleave(len(rows_idx))
    F = nu.new_zeros(B, beta.shape[0], beta.shape[0])
    F = F.index_put((bi, r, c), values)
    return F.index_put((bi, c, r), values)


def se_ard_moments(
    mean: Tensor,
    cov: Tensor,
    X: Tensor,
    beta: Tensor,
    gram_inv: Tensor,
    lengthscale: Tensor,
    variance: Tensor,
    noise: Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Exact mean, covariance and input-output covariance of :math:`h = f(x)`, :math:`x \sim \mathcal N(m, P)` (``mean``, ``cov``).

    ``f`` is drawn from the ``E`` GP posteriors, so the covariance includes the expected latent
    variance ``E_x[v_a(x)]`` on its diagonal (and ``noise`` if given). Differentiable by autograd
    (memory is then no longer bounded by ``chunk_size``); :math:`\partial M / \partial m = C^\top P^{-1}`.
    See ``docs/math/ep.md#exact-moments-of-a-gp-at-a-gaussian-input``.

    Args:
        mean: ``(..., D)`` input mean.
        cov: ``(..., D, D)`` input covariance (positive semi-definite; batch dims broadcast).
        X: ``(n, D)`` training inputs.
        beta: ``(E, n)`` weights :math:`(K_a + \sigma_a^2 I)^{-1} y_a`.
        gram_inv: ``(E, n, n)`` inverses :math:`(K_a + \sigma_a^2 I)^{-1}`.
        lengthscale: ``(E, D)``.
        variance: ``(E,)`` signal variances :math:`\alpha_a^2`.
        noise: ``(E,)`` likelihood variances, added to the covariance's diagonal when given.
        chunk_size: elements per temporary block (default :data:`DEFAULT_CHUNK_SIZE`, 64 MiB in
            float64); the cost is :math:`O(E^2 n^2)` per input whatever its value.

    Returns:
        ``(M, V, C)``: ``M`` ``(..., E)``, ``V`` ``(..., E, E)``, :math:`C = \operatorname{Cov}[x, h]` ``(..., D, E)``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> # n = 5, D = 1, E = 1
        >>> X, y = torch.linspace(-2, 2, 5).unsqueeze(-1), torch.randn(1, 5)
        >>> ell, var = torch.ones(1, 1), torch.ones(1)
        >>> gram_inv = torch.linalg.inv(se_ard_kernel(X, X, ell, var) + 0.01 * torch.eye(5))
        >>> beta = (gram_inv @ y.unsqueeze(-1)).squeeze(-1)
        >>> mu = torch.tensor([[0.3], [1.0]])  # two inputs
        >>> M, V, C = se_ard_moments(mu, torch.zeros(1, 1), X, beta, gram_inv, ell, var)
        >>> # a point input: plain prediction
        >>> m, v = se_ard_predict(mu, X, beta, gram_inv, ell, var)
        >>> M.shape, V.shape, C.shape
        (torch.Size([2, 1]), torch.Size([2, 1, 1]), torch.Size([2, 1, 1]))
        >>> bool(
        ...     torch.allclose(M, m, atol=1e-4) and torch.allclose(V.squeeze(-1), v, atol=1e-4)
        ... )
        True
    """
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    n, D = X.shape
    E = beta.shape[0]
    batch = torch.broadcast_shapes(mean.shape[:-1], cov.shape[:-2])
    mu = mean.expand(batch + (D,)).reshape(-1, D)
    S = cov.expand(batch + (D, D)).reshape(-1, D, D)
    nu = X - mu.unsqueeze(-2)  # (B, n, D)
    step = max(1, chunk_size // (3 * E * n * D))
    parts = [_mean_and_cross_cov(nu[i : i + step], S[i : i + step], beta, lengthscale, variance) for i in range(0, nu.shape[0], step)]
    M = torch.cat([m for m, _ in parts])
    C = torch.cat([c for _, c in parts])
    F = _second_moments(nu, S, beta, gram_inv, lengthscale, variance, chunk_size)
    diag = variance if noise is None else variance + noise
    V = F - M.unsqueeze(-1) * M.unsqueeze(-2) + torch.diag_embed(diag.expand(M.shape))
    return M.reshape(batch + (E,)), V.reshape(batch + (E, E)), C.reshape(batch + (D, E))
