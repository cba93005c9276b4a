"""Pure tensor math behind pyro_smc: no Pyro import, functions of tensors only.

Modules:
    weights: normalise log-weights, effective sample size, log-mean-exp.
    resample: multinomial, stratified and systematic ancestor indices.
    sinkhorn: batched log-domain entropic optimal transport: entry points (solve, sinkhorn) and docs.
    sinkhorn_types: SinkhornSettings, SinkhornResult, SinkhornConvergenceWarning, GRADIENT_MODES.
    sinkhorn_solver: the forward Sinkhorn solver in stages (forward_solve).
    sinkhorn_kernel: stabilised-kernel building blocks shared by the solver and the adjoint.
    sinkhorn_implicit: Sinkhorn for gradient="implicit" (the adjoint solve, implicit_adjoint).
    sinkhorn_unrolled: Sinkhorn for gradient="unroll" (log domain, under autograd).
    ensemble: the differentiable ensemble transform (OT resampling) as one fused autograd op.
    labels: particles grouped by a discrete label (class ids, within-class weights) for label-wise OT.
    kalman: Kalman predict/update/RTS steps and the exact log-evidence.
    affine_chain: filter and smoother of a time-varying affine chain by parallel (associative) scans.
    results: the typed results every engine returns (one name, log_evidence, for the evidence).
    gaussian: moment and natural forms of Gaussians, products, division, damping, PSD checks.
    unscented: sigma points and the unscented transform.
    gp_moments: SE-ARD GP predictions, Jacobians and exact moments at Gaussian inputs.
    kronecker: Kronecker products, solves and log-dets without forming the product.
    kronecker_tril: Gaussian terms (log-det, Mahalanobis, trace, variance, entropy) of V kron U from Cholesky factors.
    laplace: Laplace approximation by clipped Newton steps; Gaussian regression kernels.
    jacobian: per-sample gradients of a batch of values.
"""
