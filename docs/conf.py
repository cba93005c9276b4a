"""Sphinx configuration of the pyro_smc documentation.

Build (offline; warnings are errors, every reference must resolve):

    python -m sphinx -W --keep-going -n -b html -d docs/_build/doctrees docs docs/_build/html

``tests/test_docs_build.py`` runs exactly this. Nothing is downloaded: the intersphinx inventories
of Python, PyTorch and Pyro are stored in ``docs/_inventories`` (regenerate them with
``python docs/_inventories/make_inventories.py``), and the tutorials are rendered from the outputs
stored in the notebooks (no execution).
"""

from __future__ import annotations

import importlib
import inspect
import json
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the package from this checkout, installed or not

import pyro_smc  # noqa: E402

project = "pyro_smc"
author = "pyro_smc contributors"
copyright = "the pyro_smc contributors (Apache-2.0)"
release = pyro_smc.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",  # [source] links beside every documented object
    "sphinx.ext.mathjax",
    # MathJax served with the site (_static/mathjax), not from a CDN: formulas render offline.
    "sphinx-mathjax-offline",
    "myst_nb",  # Markdown (MyST) pages and the tutorial notebooks
]

exclude_patterns = ["_build", "_inventories", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

# --- MyST ----------------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath"]
# `$$...$$` inside a paragraph is display maths too (off by default in MyST, which then printed
# the dollars and ran the TeX into the text); tests/test_docs_build.py checks the built pages.
myst_dmath_double_inline = True
# The maths pages link to headings by their GitHub-style slugs (docs/math/smc.md#missing-observations).
myst_heading_anchors = 4

# --- notebooks: rendered from their stored outputs, never executed ----------------------------
# The tutorials live in the repository's tutorials/ folder; Sphinx reads only files under docs/,
# so each build copies them to docs/tutorials/ (git-ignored; a copy is rewritten only when its
# notebook changed, and a copy whose notebook is gone is removed).
_NOTEBOOKS = {nb.name: nb for nb in sorted((ROOT / "tutorials").glob("*.ipynb"))}
for _copy in (DOCS / "tutorials").glob("*.ipynb"):
    if _copy.name not in _NOTEBOOKS:
        _copy.unlink()


def _site_copy(notebook: pathlib.Path) -> bytes:
    """The notebook as the site shows it: a download link to the repository's file under its
    title (the repository's notebook stays plain Markdown, readable on GitHub and in Jupyter)."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        title, _, rest = "".join(cell["source"]).partition("\n")
        if title.startswith("# "):
            link = f"{{download}}`Download this notebook <../../tutorials/{notebook.name}>`"
            cell["source"] = f"{title}\n\n{link} ({notebook.name}, with its outputs).\n{rest}"
        break
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()


for _name, _nb in _NOTEBOOKS.items():
    _copy = DOCS / "tutorials" / _name
    _site = _site_copy(_nb)
    if not _copy.exists() or _copy.read_bytes() != _site:
        _copy.write_bytes(_site)
nb_execution_mode = "off"
nb_merge_streams = True
# The tutorial notebooks (not edited from here) put H3 headings under their H1 title.
suppress_warnings = ["myst.header"]

# --- autodoc -------------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Defaults as written in the source (init_loc_fn=init_to_median, not a function repr that breaks
# the signature parser).
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
# As Pyro's docs: a method without its own docstring shows none, not torch's inherited
# "Define the computation performed at every call" under AutoKroneckerFlow.forward.
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections become field lists, not a second description of each dataclass field.
napoleon_use_ivar = True
# Package docstrings list their modules under "Modules:", formatted like "Args:".
napoleon_custom_sections = [("Modules", "params_style")]

# --- intersphinx: local inventories, the build machine is offline -------------------------------
_INV = DOCS / "_inventories"
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", str(_INV / "python.inv")),
    "torch": ("https://pytorch.org/docs/stable", str(_INV / "torch.inv")),
    "pyro": ("https://docs.pyro.ai/en/stable", str(_INV / "pyro.inv")),
}
intersphinx_timeout = 1

# --- HTML ----------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"pyro_smc {release}"
html_static_path = ["_static"]
html_css_files = ["pyro_smc.css"]

# --- nitpicky mode -------------------------------------------------------------------------------
nitpicky = True
# The offline Python inventory in docs/_inventories has no entry for enum.Enum and enum.IntEnum
# (the bases of GradientEstimator and ObservationStatus).
nitpick_ignore: list[tuple[str, str]] = [("py:class", "enum.Enum"), ("py:class", "enum.IntEnum")]
nitpick_ignore_regex: list[tuple[str, str]] = []


# --- references to other names of a documented object --------------------------------------------
# Every public object is documented once, under the name users import it by (pyro_smc.SMC,
# pyro_smc.ops.results.FilterResult, ...), but docstrings and signatures may name it by its
# defining module (pyro_smc.infer.smc.engine.SMC), by another module that re-exports it
# (pyro_smc.infer.SMC), or by a bare name that resolves in the docstring's own module. The
# handler below imports what the reference names and, when it is an object documented under
# another name, links there. ALIASES renames the few external spellings that signatures show
# (``Tensor`` from ``from torch import Tensor``, torch's C-level Generator) to the names in the
# inventories; the renamed reference then goes on to intersphinx.
ALIASES = {
    "Tensor": "torch.Tensor",
    "Module": "torch.nn.Module",
    "Size": "torch.Size",
    "torch._C.Generator": "torch.Generator",
    "ExpandedDistribution": "pyro.distributions.torch_distribution.ExpandedDistribution",
    # pyro_smc.resamplers.base.Particles, the alias dict[str, Tensor] of a particle dict.
    "Particles": "dict",
}


def _import(path: str):
    """The object a dotted path names, or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


_DOCUMENTED: dict[str, object] = {}


def _documented(env) -> dict[int, str]:
    """``{id(object): documented name}`` over the Python objects this build documents."""
    objects = env.get_domain("py").objects
    cache = _DOCUMENTED
    if cache.get("size") != len(objects):
        ids = {}
        for name, entry in objects.items():
            if name.startswith("pyro_smc") and entry.objtype in {"module", "class", "exception", "function", "method", "property"}:
                obj = _import(name)
                if obj is not None:
                    ids.setdefault(id(obj), name)
        cache.update(size=len(objects), ids=ids)
    return cache["ids"]


def _missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    if target in ALIASES:
        node["reftarget"] = ALIASES[target]  # intersphinx, which runs next, resolves the new name
        return None
    module, cls = node.get("py:module"), node.get("py:class")
    scopes = [target]
    if module and cls:
        scopes.append(f"{module}.{cls}.{target}")
        owner = _import(f"{module}.{cls}")  # a bare name in a docstring resolves in its defining module
        if getattr(owner, "__module__", None):
            scopes.append(f"{owner.__module__}.{target}")
    if module:
        scopes.append(f"{module}.{target}")
    documented = _documented(env)
    for path in scopes:
        if not path.startswith("pyro_smc"):
            continue
        obj = _import(path)
        name = documented.get(id(obj)) if obj is not None else None
        if name is not None:
            py = env.get_domain("py")
            for role in (node["reftype"], "obj"):
                ref = py.resolve_xref(env, node["refdoc"], app.builder, role, name, node, contnode)
                if ref is not None:
                    return ref
    return None


# --- base classes --------------------------------------------------------------------------------
# "Bases:" lines show public classes only: a private base, or a base from an implementation module
# that users never import, is replaced by its own bases.
PUBLIC_MODULES = [
    "pyro_smc",
    "pyro_smc.infer",
    "pyro_smc.resamplers",
    "pyro_smc.models",
    "pyro_smc.guides",
    "pyro_smc.gp",
    "pyro_smc.distributions",
    "pyro_smc.regression",
    "pyro_smc.arviz",
    "pyro_smc.distributed",
]


def _public_ids() -> set[int]:
    ids = set()
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        ids.update(id(getattr(module, attr)) for attr in getattr(module, "__all__", []))
    return ids


def _public_bases(cls, public: set[int]) -> list:
    if id(cls) in public or not cls.__module__.startswith("pyro_smc"):
        return [cls]
    if cls.__module__.startswith("pyro_smc.ops") and not cls.__name__.startswith("_"):
        return [cls]  # documented on the pyro_smc.ops page
    out = []
    for base in cls.__bases__:
        out.extend(b for b in _public_bases(base, public) if b not in out)
    return out


def _process_bases(app, name, obj, options, bases):
    public = _public_ids()
    new = []
    for base in bases:
        new.extend(b for b in _public_bases(base, public) if b not in new)
    bases[:] = [b for b in new if b is not object] or [object]


# --- links to the mathematics --------------------------------------------------------------------
# Docstrings cite the derivations as ``docs/math/<page>.md#<anchor>`` (readable in a terminal and on
# GitHub); on the site they become links. Autodoc pages sit one level below docs/ (api/...), as do
# the maths pages, so the relative target is ../math/<page>.html#<anchor>.
_MATH_CITATION = re.compile(r"``docs/math/(\w+)\.md(?:#([\w-]+))?``")


def _link_math_citations(app, what, name, obj, options, lines):
    for i, line in enumerate(lines):
        lines[i] = _MATH_CITATION.sub(
            lambda m: f"`docs/math/{m[1]}.md{'#' + m[2] if m[2] else ''} <../math/{m[1]}.html{'#' + m[2] if m[2] else ''}>`__", line
        )


# --- names in ``code`` become links -------------------------------------------------------------
# Prose names Pyro's, PyTorch's and this package's objects as inline code (`SVI`, `pyro.param`,
# `dist.Bernoulli`, `OTResampler`, `SMC.run`); Pyro's own docs link such names by hand, and here
# every one of them is linked. An inline literal (not in a title or an existing link) whose text,
# less a trailing "()", is a name below becomes a cross-reference: a Pyro or PyTorch name in
# docs/_inventories/objects.txt (dotted, or a class by its bare name where that is unambiguous),
# `dist.X`, `poutine.X` and `nn.X` as Pyro's examples import them, or a public pyro_smc name
# (bare, or Name.member for a method or property). tests/test_docs_build.py fails on a Pyro or
# PyTorch name left unlinked in the built pages.
_LITERAL_PREFIXES = {"dist.": "pyro.distributions.", "poutine.": "pyro.poutine.", "nn.": "torch.nn."}


def _literal_targets() -> dict[str, str]:
    """``{text of an inline literal: the name it links to}``."""
    targets: dict[str, str] = {}
    bare: dict[str, dict[str, str]] = {}  # a class's bare name -> {its page and anchor: full name}
    for line in (DOCS / "_inventories" / "objects.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) != 4 or line.startswith("#") or parts[0] not in {"torch", "pyro"}:
            continue
        _, role, name, uri = parts
        if name == "pyro":
            continue  # the bare word "pyro" is the project, not a link
        targets[name] = name
        if role in {"py:class", "py:exception"} and not name.startswith(("pyro.distributions", "torch.")):
            bare.setdefault(name.rsplit(".", 1)[-1], {}).setdefault(uri, name)
    for short, by_uri in bare.items():
        if len(by_uri) == 1:  # one object under several names is still unambiguous
            targets.setdefault(short, next(iter(by_uri.values())))
    for module in PUBLIC_MODULES:
        for attr in getattr(importlib.import_module(module), "__all__", []):
            targets.setdefault(attr, f"{module}.{attr}")
    return targets


_TARGETS: dict[str, str] = {}


def _literal_target(text: str) -> str | None:
    if not _TARGETS:
        _TARGETS.update(_literal_targets())
    text = text.removesuffix("()")
    for prefix, full in _LITERAL_PREFIXES.items():
        if text.startswith(prefix) and full + text[len(prefix):] in _TARGETS:
            return full + text[len(prefix):]
    if text in _TARGETS:
        return _TARGETS[text]
    head, _, member = text.partition(".")
    owner = _TARGETS.get(head)
    if member.isidentifier() and owner and owner.startswith("pyro_smc"):
        # a method or property has an entry of its own; a dataclass field or enum member does not
        attr = inspect.getattr_static(_import(owner), member, None)
        if isinstance(attr, (property, staticmethod, classmethod)) or inspect.isfunction(attr):
            return f"{owner}.{member}"
    return None


def _link_code_literals(app, doctree):
    from docutils import nodes
    from sphinx import addnodes

    for node in list(doctree.findall(nodes.literal)):
        if node.get("classes") and "xref" in node["classes"]:
            continue
        parent, inside = node.parent, False
        while parent is not None:
            if isinstance(parent, (nodes.reference, addnodes.pending_xref, nodes.title, nodes.literal_block, addnodes.desc_signature)):
                inside = True
                break
            parent = parent.parent
        target = None if inside else _literal_target(node.astext())
        if target is None:
            continue
        xref = addnodes.pending_xref("", refdomain="py", reftype="obj", reftarget=target, refexplicit=True, refwarn=True)
        node.replace_self(xref)
        xref += node


def setup(app):
    app.connect("autodoc-process-docstring", _link_math_citations)
    app.connect("missing-reference", _missing_reference, priority=400)
    app.connect("autodoc-process-bases", _process_bases)
    app.connect("doctree-read", _link_code_literals)
