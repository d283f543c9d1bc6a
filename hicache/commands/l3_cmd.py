"""`hicache l3 inspect --l3-path DIR [--verify]`: report on an L3 store without modifying it."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("l3", help="L3 (NVMe) store tools")
    l3sub = p.add_subparsers(dest="l3_command", required=True, metavar="L3_COMMAND")
    q = l3sub.add_parser("inspect", help="pages, bytes, capacity, namespaces and I/O path of a store (read-only)")
    q.add_argument("--l3-path", required=True, help="the store's directory")
    q.add_argument("--verify", action="store_true", help="re-read every page and check its checksum")
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from tiers.l3 import L3Error
    from tiers.l3.inspect import format_report, inspect_store

    try:
        report = inspect_store(args.l3_path, verify=args.verify)
    except (L3Error, OSError) as e:
        print(f"hicache l3 inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    bad = report["verify"]["bad"] if args.verify else 0
    lost = report.get("dropped_entries", 0) if args.verify else 0
    if bad:
        print(f"hicache l3 inspect: {bad} page(s) failed verification (checksum mismatch or unreadable)",
              file=sys.stderr)
    if lost:
        print(f"hicache l3 inspect: {lost} index entries are lost (they point outside the slab, which is shorter "
              "than its header says, or are malformed)", file=sys.stderr)
    return 1 if bad or lost else 0
