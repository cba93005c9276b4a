"""Writes the intersphinx inventories python.inv, torch.inv and pyro.inv from objects.txt.

The documentation is built offline, so the inventories of the Python, PyTorch and Pyro docs
cannot be downloaded at build time; instead they are generated from the hand-maintained list
objects.txt (only the external names pyro_smc's docstrings reference, each pointing at its
public URL) and committed. Run after editing objects.txt:

    python docs/_inventories/make_inventories.py

Needs ``sphobjinv`` (in the ``docs`` extra).
"""

from __future__ import annotations

import pathlib
from collections import defaultdict

import sphobjinv as soi

HERE = pathlib.Path(__file__).resolve().parent
PROJECTS = {"python": ("Python", "3"), "torch": ("PyTorch", "stable"), "pyro": ("Pyro", "stable")}


def read_objects(path: pathlib.Path = HERE / "objects.txt") -> dict[str, list[tuple[str, str, str, str]]]:
    """``{inventory: [(domain, role, name, uri), ...]}`` from the list's non-comment lines."""
    out: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 4 or parts[0] not in PROJECTS or ":" not in parts[1]:
            raise ValueError(f"{path.name}:{number}: expected '<inventory> <domain:role> <name> <uri>', got {line!r}")
        inventory, domain_role, name, uri = parts
        domain, role = domain_role.split(":")
        out[inventory].append((domain, role, name, uri))
    return out


def main() -> None:
    for inventory, entries in read_objects().items():
        inv = soi.Inventory()
        inv.project, inv.version = PROJECTS[inventory]
        for domain, role, name, uri in entries:
            inv.objects.append(soi.DataObjStr(name=name, domain=domain, role=role, priority="1", uri=uri, dispname="-"))
        target = HERE / f"{inventory}.inv"
        soi.writebytes(str(target), soi.compress(inv.data_file(contract=True)))
        print(f"{target.name}: {len(entries)} names")


if __name__ == "__main__":
    main()
