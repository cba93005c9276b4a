"""The documentation builds with warnings as errors, and every public name is documented.

``test_docs_build`` runs the Sphinx build as CI and a contributor run it (offline, warnings as
errors, nitpicky references: a broken cross-reference, a malformed docstring or a tutorial that
does not render fails it) and then checks that every public object appears in the built site's
inventory. The default test run leaves out two things that only re-render what the build has
already checked and took half its time (64 s against 33 s alone on the 2-core development
machine, 2026-12-07): the ``[source]`` pages of ``sphinx.ext.viewcode`` (86 highlighted copies
of the package's modules) and furo's per-object entries in each page's sidebar
(``toc_object_entries``). ``PYRO_SMC_FULL=1`` builds the site exactly as published. The test
run starts this test first (``tests/conftest.py``).

``test_public_names_have_examples`` lists the public names (``__all__`` of the public modules and
of the ``pyro_smc.ops`` modules) with no docstring or with no ``Example:`` / ``Examples:`` section,
and compares the list with ``WITHOUT_EXAMPLES``, so that a new name without an example fails, and
so does a name that gained one without leaving the list.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _conf_constant(name: str):
    """A literal assigned at the top of ``docs/conf.py``, read without running it (importing it
    would copy the tutorials into docs/)."""
    for node in ast.parse((DOCS / "conf.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == name for target in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(name)


# One list for the site and the tests: the modules whose __all__ is the public API.
PUBLIC_MODULES = _conf_constant("PUBLIC_MODULES")


def _ops_modules() -> list[str]:
    """The ``pyro_smc.ops`` modules; ``results`` first, where the shared result types are documented."""
    import pyro_smc.ops

    names = sorted(info.name for info in pkgutil.iter_modules(pyro_smc.ops.__path__))
    return [f"pyro_smc.ops.{name}" for name in sorted(names, key=lambda name: (name != "results", name))]


def public_objects() -> dict[str, object]:
    """``{name: object}`` over every ``__all__`` entry of the public and ops modules, each object
    once, under the first module (in the order above) that exports it."""
    out: dict[str, object] = {}
    seen: set[int] = set()
    for module_name in PUBLIC_MODULES + _ops_modules():
        module = importlib.import_module(module_name)
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if id(obj) not in seen:
                seen.add(id(obj))
                out[f"{module_name}.{attr}"] = obj
    return out


def _is_documentable(obj) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj)


def test_docs_build(tmp_path):
    """``sphinx-build -W --keep-going -n`` succeeds, and every public class and function is in the site."""
    trimmed = []
    if os.environ.get("PYRO_SMC_FULL") != "1":
        # The module docstring says why; -D replaces a list setting by a comma-separated one.
        extensions = [name for name in _conf_constant("extensions") if name != "sphinx.ext.viewcode"]
        trimmed = ["-D", "extensions=" + ",".join(extensions), "-D", "toc_object_entries=0"]
    cmd = [sys.executable, "-m", "sphinx", *trimmed, "-W", "--keep-going", "-n", "-j", "1", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"

    from sphinx.util.inventory import InventoryFile

    with open(tmp_path / "html" / "objects.inv", "rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    documented = set()
    for role, entries in inventory.items():
        if role.startswith("py:"):
            documented.update(entries)
    documented_ids = set()
    for name in documented:
        module_name, _, attr = name.rpartition(".")
        try:
            documented_ids.add(id(getattr(importlib.import_module(module_name), attr)))
        except (ImportError, AttributeError, ValueError):
            pass  # a method or attribute: its class is what counts
    missing = [name for name, obj in public_objects().items() if _is_documentable(obj) and id(obj) not in documented_ids]
    assert not missing, f"public names missing from the API reference: {missing}"
    _check_built_maths(tmp_path / "html")
    _check_names_linked(tmp_path / "html")
    _check_docstring_maths(tmp_path / "html")


# TeX that reached a page as text: a dollar, or a control word of the kinds the pages use.
_STRAY_TEX = re.compile(r"\$|\\(?:frac|tfrac|mathcal|mathbf|mathrm|operatorname|sum|prod|int|log|exp|top|sigma|mu|alpha|beta|theta|lambda|left|right|begin|end|big|Big|lVert|rVert|mid|nabla|delta|qquad|quad)\b")
_CODE_TAGS = {"script", "style", "pre", "code", "kbd", "samp", "textarea"}
_VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def stray_tex(html: str) -> list[str]:
    """The snippets of ``html`` where TeX shows as text: outside the math elements MathJax
    typesets (class ``math``) and outside code, scripts and highlighted blocks.

    Example: ``stray_tex('<p>a $x$ b</p>')`` finds the two dollars, ``stray_tex('<span
    class="math">\\(x\\)</span>')`` nothing.
    """
    from html.parser import HTMLParser

    found: list[str] = []

    class Scan(HTMLParser):
        def __init__(self):
            super().__init__()
            self.open: list[tuple[str, bool]] = []
            self.skipping = 0

        def handle_starttag(self, tag, attrs):
            if tag in _VOID_TAGS:
                return
            classes = (dict(attrs).get("class") or "").split()
            skip = tag in _CODE_TAGS or "math" in classes or any(c.startswith("highlight") for c in classes)
            self.open.append((tag, skip))
            self.skipping += skip

        def handle_endtag(self, tag):
            while self.open and tag not in _VOID_TAGS:
                name, skip = self.open.pop()
                self.skipping -= skip
                if name == tag:
                    break

        def handle_data(self, data):
            if not self.skipping:
                found.extend(data[max(0, m.start() - 40) : m.end() + 40].replace("\n", " ") for m in _STRAY_TEX.finditer(data))

    Scan().feed(html)
    return found


def test_stray_tex_finds_unrendered_maths():
    assert len(stray_tex("<p>the weight $w$ and $$x = 1$$</p>")) == 6
    assert stray_tex('<p>a <span class="math notranslate">\\(\\frac12\\)</span> b</p><pre>$ pip</pre>') == []
    assert stray_tex("<p>covariance: \\frac{1}{2} \\sigma</p>") != []


def _check_built_maths(html: pathlib.Path) -> None:
    """Every page's maths is typeset (no TeX as text) by the MathJax served with the site."""
    pages = [p for p in html.rglob("*.html") if not {"_static", "_modules", "_sources"} & set(p.relative_to(html).parts)]
    stray = {str(p.relative_to(html)): hits for p in pages if (hits := stray_tex(p.read_text(encoding="utf-8")))}
    assert not stray, "maths shown as raw TeX (a $$ block inside a paragraph whose next line starts like a list item, " + (
        "'- x' or '+ x', ends the block: write '{}- x'):\n" + "\n".join(f"{page}: {len(hits)} x, first: {hits[0]!r}" for page, hits in stray.items())
    )
    assert (html / "_static" / "mathjax" / "tex-chtml.js").is_file(), "MathJax is not served with the site (sphinx-mathjax-offline)"
    with_maths = [p for p in pages if 'class="math' in p.read_text(encoding="utf-8")]
    assert with_maths, "no page has maths: the check above checked nothing"
    for page in with_maths:
        text = page.read_text(encoding="utf-8")
        assert "_static/mathjax/tex-chtml.js" in text and "cdn.jsdelivr" not in text, f"{page.name} loads MathJax from elsewhere"


# A Pyro or PyTorch name in inline code: dotted (pyro.param, torch.save, dist.Bernoulli), or a Pyro
# class or exception by its bare name (SVI, AutoNormal; the bare names docs/conf.py links).
_EXTERNAL_NAME = re.compile(r"(?:pyro|torch|dist|poutine|nn)\.[A-Za-z_][\w.]*(?:\(\))?")


def _bare_pyro_names() -> set[str]:
    names = set()
    for line in (DOCS / "_inventories" / "objects.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "pyro" and parts[1] in {"py:class", "py:exception"} and not parts[2].startswith("pyro.distributions"):
            names.add(parts[2].rsplit(".", 1)[-1])
    return names


def unlinked_code(html: str) -> list[str]:
    """The texts of inline code (``<code class="... literal ...">``) outside links, headings and
    code blocks.

    Example: ``unlinked_code('<p><code class="docutils literal">SVI</code> <a href="#"><code
    class="docutils literal">SMC</code></a></p>')`` is ``["SVI"]``.
    """
    from html.parser import HTMLParser

    found: list[str] = []
    shielding = {"a", "pre", "h1", "h2", "h3", "h4", "h5", "h6"}

    class Scan(HTMLParser):
        def __init__(self):
            super().__init__()
            self.open: list[str] = []
            self.text: list[str] | None = None
            self.depth = 0

        def handle_starttag(self, tag, attrs):
            if tag in _VOID_TAGS:
                return
            self.open.append(tag)
            classes = (dict(attrs).get("class") or "").split()
            if tag == "code" and "literal" in classes and self.text is None and not shielding & set(self.open[:-1]):
                self.text, self.depth = [], len(self.open)

        def handle_endtag(self, tag):
            if tag in _VOID_TAGS:
                return
            if self.text is not None and tag == "code" and len(self.open) == self.depth:
                found.append("".join(self.text))
                self.text = None
            while self.open and self.open.pop() != tag:
                pass

        def handle_data(self, data):
            if self.text is not None:
                self.text.append(data)

    Scan().feed(html)
    return found


def test_unlinked_code_finds_names_outside_links():
    page = ('<h2><code class="docutils literal">SVI</code></h2><p><code class="docutils literal">pyro.param</code> '
            '<a href="x"><code class="docutils literal">SVI</code></a></p><pre><code class="literal">torch.save</code></pre>')
    assert unlinked_code(page) == ["pyro.param"]
    assert _EXTERNAL_NAME.fullmatch("dist.Bernoulli") and not _EXTERNAL_NAME.fullmatch("pyro_smc.SMC")
    assert {"SVI", "AutoNormal", "SMCFilter", "PyroModule"} <= _bare_pyro_names()


def _check_names_linked(html: pathlib.Path) -> None:
    """Every Pyro or PyTorch name the prose shows as inline code links to its documentation
    (docs/conf.py's ``_link_code_literals``; a new name goes into docs/_inventories/objects.txt)."""
    bare = _bare_pyro_names()
    pages = [p for p in html.rglob("*.html") if not {"_static", "_modules", "_sources"} & set(p.relative_to(html).parts)]
    missing = {}
    for page in pages:
        names = [t for t in unlinked_code(page.read_text(encoding="utf-8")) if _EXTERNAL_NAME.fullmatch(t) or t.removesuffix("()") in bare]
        if names:
            missing[str(page.relative_to(html))] = sorted(set(names))
    assert not missing, "Pyro/PyTorch names in inline code without a link (add them to docs/_inventories/objects.txt): " + repr(missing)


# The docstrings whose formulas are typeset (:math:`...`) rather than shown as ASCII literals: every
# module of the package. The API pages listed must show typeset maths: the engines (api/pyro_smc), the
# result types, schedules and factors (api/infer), the resamplers, guides, models, MatrixNormal, the
# GPs and the tensor operations (api/ops).
_MATHS_SOURCES = ["pyro_smc/**/*.py"]
_MATHS_PAGES = [
    "api/pyro_smc.html", "api/infer.html", "api/resamplers.html", "api/guides.html", "api/models.html",
    "api/distributions.html", "api/gp.html", "api/ops.html",
]
# A double-backtick literal that is an ASCII formula: a sum or product (sum_j, prod_k), a transpose
# (B^T), an estimate (log Z_hat), a Gaussian law (x ~ N(...)), a Kronecker product or a log-density.
_LITERAL = re.compile(r"``(.+?)``", re.S)
_FORMULA = re.compile(r"\b(?:sum|prod)_|\^T\b|Z_hat|\s~\s*N\(|\bkron\b|\blog p\(")


def formula_literals(source: str) -> list[str]:
    """The double-backtick literals of the docstrings in ``source`` (a module's text, doctest lines
    left out) that are ASCII formulas, to be written as :math:`...` instead.

    Example: of a docstring that shows ``W = M + A E B^T`` and ``num_particles`` as literals,
    the first is found, the second (a name) is not.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and (doc := ast.get_docstring(node, clean=False)):
            prose = "\n".join(line for line in doc.splitlines() if not line.lstrip().startswith((">>>", "...")))
            found.extend(m[0] for m in _LITERAL.finditer(prose) if _FORMULA.search(m[1]))
    return found


def test_formula_literals_finds_ascii_maths_only():
    doc = '"""``x~_i = sum_j P_ij x_j`` ``log Z_hat`` ``E_ij ~ N(0, 1)`` ``U = A E B^T`` ``x ~ N(mean, cov)``"""'
    assert len(formula_literals(doc)) == 5
    code = 'r"""``gradient="stop_gradient"`` ``(..., N, d)`` ``torch.sum`` ``num_particles`` ``int >= 1`` :math:`\\log \\hat Z`"""'
    assert formula_literals(code) == []


def _check_docstring_maths(html: pathlib.Path) -> None:
    """The API pages of the engines, their helpers, resamplers, guides, models, distributions and
    tensor operations typeset their formulas, and no docstring of the package still writes one as
    an ASCII literal."""
    without = [page for page in _MATHS_PAGES if 'class="math' not in (html / page).read_text(encoding="utf-8")]
    assert not without, f"API pages without typeset maths (a formula written as ``...`` instead of :math:`...`?): {without}"
    left = {}
    sources = sorted({path for pattern in _MATHS_SOURCES for path in ROOT.glob(pattern)})
    assert len(sources) >= 50, f"the maths check read {len(sources)} modules: is _MATHS_SOURCES' pattern right?"
    for path in sources:
        if hits := formula_literals(path.read_text(encoding="utf-8")):
            left[str(path.relative_to(ROOT))] = hits
    assert not left, "formulas written as ``...`` literals; write them as :math:`...` (a raw docstring, r\"\"\"): " + repr(left)


_EXAMPLE = re.compile(r"^\s*Examples?\b[^\n]*:\s*$", re.M)

# Public names allowed to lack an ``Example:`` section in their own docstring. Empty: every public
# name has one (December 2026). Keep it empty; a name added here needs a reason in a comment.
WITHOUT_EXAMPLES: dict[str, list[str]] = {}


def _attr_documented(obj, name: str) -> bool:
    """Whether a data name (a constant) has a ``#:`` doc comment in a module that defines it."""
    from sphinx.pycode import ModuleAnalyzer

    attr = name.rpartition(".")[2]
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("pyro_smc") and getattr(module, attr, None) is obj:
            try:
                docs = ModuleAnalyzer.for_module(module.__name__).find_attr_docs()
            except Exception:  # noqa: BLE001 - a module without source
                continue
            if ("", attr) in docs:
                return True
    return False


def test_public_names_have_docstrings_and_examples():
    undocumented, without_examples = [], set()
    for name, obj in public_objects().items():
        if not _is_documentable(obj):
            if not _attr_documented(obj, name):
                undocumented.append(name)
            continue
        doc = obj.__doc__
        if not doc or not doc.strip():
            undocumented.append(name)
        elif not _EXAMPLE.search(doc):
            without_examples.add(name)
    assert not undocumented, f"public names without a docstring (a '#:' comment for a constant): {undocumented}"
    allowed = {f"{module}.{attr}" for module, attrs in WITHOUT_EXAMPLES.items() for attr in attrs}
    new = sorted(without_examples - allowed)
    assert not new, f"public names without an 'Example:' section in their docstring: {new}"
    stale = sorted(allowed - without_examples)
    assert not stale, f"these names now have an example (or are gone): delete them from WITHOUT_EXAMPLES: {stale}"


def test_intersphinx_inventories_match_their_list():
    """docs/_inventories/*.inv hold exactly the names of objects.txt (run make_inventories.py after editing it)."""
    from sphinx.util.inventory import InventoryFile

    sys.path.insert(0, str(DOCS / "_inventories"))
    try:
        make_inventories = importlib.import_module("make_inventories")
    finally:
        sys.path.pop(0)
    listed = make_inventories.read_objects()
    assert sorted(listed) == ["pyro", "python", "torch"]
    for name, entries in listed.items():
        with open(DOCS / "_inventories" / f"{name}.inv", "rb") as stream:
            inventory = InventoryFile.load(stream, "BASE", lambda base, uri: f"{base}/{uri}")
        stored = {(role, target, item[2] if isinstance(item, tuple) else item.uri) for role, items in inventory.items() for target, item in items.items()}
        expected = {(f"{domain}:{role}", target, f"BASE/{uri}") for domain, role, target, uri in entries}
        assert stored == expected, f"{name}.inv is out of date: run python docs/_inventories/make_inventories.py"


@pytest.mark.parametrize("page", ["smc", "pmcmc", "smc2", "ep", "kronecker", "streaming"])
def test_every_engine_has_a_page_in_the_toctree(page):
    assert (DOCS / "engines" / f"{page}.md").exists()
    assert f"engines/{page}" in (DOCS / "index.md").read_text()


def test_public_members_have_their_own_docstrings():
    """Every public method and property of a public class defined here has a docstring of its own:
    the site does not inherit docstrings (``autodoc_inherit_docstrings = False``, as Pyro's), so
    an override without one would show nothing, and inheriting showed torch's boilerplate."""
    missing = []
    for name, obj in public_objects().items():
        if not inspect.isclass(obj):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            if isinstance(value, property):
                doc = value.__doc__
            elif inspect.isfunction(getattr(value, "__func__", value)):
                doc = getattr(value, "__func__", value).__doc__
            else:
                continue
            if not (doc or "").strip():
                missing.append(f"{name}.{attr}")
    assert not missing, f"public members without a docstring of their own: {missing}"
