"""``python -m mpidist plan``: the planner on the command line (the parser and the command, kept with the planner)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from mpidist.files import write_text_atomic

from .estimate import plan
from .layouts import COMM_HOOKS, RECOMPUTE, SCHEDULES, SHARDINGS
from .model import ModelShape
from .profile import Profile, load_profile, profile_names
from .report import format_table, plot, to_json

__all__ = ["add_parser", "run"]


def _csv(choices):
    def parse(text):
        items = tuple(t for t in text.split(",") if t)
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r} (expected a comma-separated subset of "
                                             f"{', '.join(choices)})")
        return items
    return parse


def _ints(minimum):
    """Return a parser of a comma-separated list of ints >= ``minimum`` (sorted, each once): ``--chunks`` (model
    chunks per rank for the interleaved schedule, >= 2), ``--tp/--pp/--dp/--micro-batch`` (sizes, >= 1)."""
    def parse(text):
        try:
            values = tuple(int(t) for t in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints >= {minimum} (got {text!r})")
        return tuple(sorted(set(values)))
    return parse


def _precision(args) -> dict:
    given = {"param_dtype": args.param_dtype, "compute_dtype": args.compute_dtype, "gather_dtype":
             args.fsdp_gather_dtype, "reduce_dtype": args.fsdp_reduce_dtype,
             "comm_hook": "" if args.comm_hook == "none" else args.comm_hook}
    return {k: v for k, v in given.items() if v}


def add_parser(sub):
    """Add the ``plan`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("plan", allow_abbrev=False, help="predict memory and step time of every (dp, tp, pp, FSDP, "
                       "micro-batch, schedule, recompute) layout, ranked",
                       description="Rank every layout of a GPT-shaped model on N ranks by predicted step time, with "
                       "per-rank memory by component, communication per collective, and why the others do not run. "
                       "--calibrate measures this machine and writes a profile instead.")
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--hidden", type=int, help="model width")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention: k/v heads, a divisor of "
                   "--heads (default: --heads, multi-head attention)")
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden units (default 4 * hidden)")
    p.add_argument("--mlp", default="gelu", help="the MLP: gelu (GPT-2's, default) or swiglu (gated: Llama's; "
                   "--ffn units each for the gate, up and down projections)")
    p.add_argument("--norm", default="layernorm", help="the norms: layernorm (GPT-2's, default) or rmsnorm (Llama's)")
    p.add_argument("--positions", default="learned", help="learned (a position table, GPT-2's; default) or rope "
                   "(rotary q and k, Llama's)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--untied", action="store_true", help="the LM head has its own weight (default: tied)")
    p.add_argument("--no-bias", action="store_true", help="no biases in the linears and norms (GPTConfig(bias=False))")
    p.add_argument("--dropout", type=float, default=0.0, help="GPTConfig.dropout: its masks are kept (default 0)")
    p.add_argument("--dtype", default="float32", help="parameter and activation dtype (default float32)")
    p.add_argument("--batch", type=int, help="global batch in samples")
    p.add_argument("--ranks", type=int, help="number of ranks")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: all on one node)")
    p.add_argument("--profile", default="local", help=f"hardware profile: a shipped name ({', '.join(profile_names())}) "
                   "or a JSON file (default local)")
    p.add_argument("--schedules", type=_csv(SCHEDULES), default=SCHEDULES, help="pipeline schedules to consider")
    p.add_argument("--sharding", type=_csv(SHARDINGS), default=SHARDINGS, help="data-parallel kinds to consider")
    p.add_argument("--chunks", type=_ints(2), default=(2,), help="model chunks per rank the interleaved "
                   "schedule may take (Megatron-LM's virtual pipeline size), e.g. 2,3,4 (default 2)")
    p.add_argument("--recompute", type=_csv(RECOMPUTE), default=RECOMPUTE, help="recompute options to consider")
    p.add_argument("--param-dtype", default="", help="mixed precision: parameters stored in this dtype (an "
                   "nn.precision.Policy; 16-bit: AdamW keeps float32 masters); default: --dtype")
    p.add_argument("--compute-dtype", default="", help="the Policy's activation dtype (default: the parameters')")
    p.add_argument("--comm-hook", choices=COMM_HOOKS, default="none", help="DDP layouts' communication hook")
    p.add_argument("--fsdp-gather-dtype", default="", help="FSDP layouts: gather units in this dtype")
    p.add_argument("--fsdp-reduce-dtype", default="", help="FSDP layouts: reduce-scatter gradients in this dtype")
    p.add_argument("--max-micro-batch", type=int, default=None, help="largest micro-batch to consider")
    for flag, what in (("--tp", "tensor-parallel"), ("--pp", "pipeline-parallel"), ("--dp", "data-parallel")):
        p.add_argument(flag, type=_ints(1), default=None, help=f"only these {what} sizes, e.g. 8 or 4,8 (default: "
                       "every divisor of --ranks); each must divide --ranks")
    p.add_argument("--micro-batch", type=_ints(1), default=None, help="only these micro-batch sizes, e.g. 1,2 (default: "
                   "every divisor of a replica's batch)")
    p.add_argument("--top", type=int, default=15, help="layouts to show (default 15)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", metavar="FILE", default=None, help="also draw the top layouts' step time and memory by "
                   "component to FILE (matplotlib's formats; without matplotlib, .svg only)")
    p.add_argument("--calibrate", metavar="OUT", default=None, help="measure this machine (matmul curve, memory "
                   "bandwidth, alpha-beta over mpiexec -n 2) and write a profile to OUT")
    return p


def network_assumptions(profile) -> str:
    """Return one line saying how ``profile`` crosses nodes (what a multi-node plan rests on)."""
    inter = profile.tiers["inter"]
    how = ("a group's collectives cross a node on all its ranks' links (multi_rail: NCCL's rings)"
           if profile.multi_rail else "a group's ring crosses each node once, on one link")
    if profile.halving_doubling_allreduce:
        how += "; allreduce by recursive halving and doubling (MPICH)"
    return (f"between nodes: {inter.bandwidth / 1e9:.3g} GB/s per link x efficiency {inter.efficiency:.2g}, "
            f"{inter.latency_s * 1e6:.3g} us, {inter.ranks_per_link} rank(s) per link; {how}")


def run(args) -> int:
    """Run ``mpidist plan``; return the exit status (2 on bad arguments)."""
    if args.calibrate:
        from .calibrate import calibrate
        data = calibrate(name=os.path.splitext(os.path.basename(args.calibrate))[0])
        Profile.from_dict(data, where="calibrate")   # what is written loads
        write_text_atomic(args.calibrate, json.dumps(data, indent=1) + "\n")
        print(f"mpidist plan: wrote {args.calibrate}")
        return 0
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "heads", "batch", "ranks")
               if getattr(args, n) is None]
    if missing:
        print(f"mpidist plan: missing {', '.join(missing)} (or --calibrate OUT)", file=sys.stderr)
        return 2
    try:
        shape = ModelShape(args.layers, args.hidden, args.heads, args.vocab, args.seq, args.ffn,
                           tie_weights=not args.untied, bias=not args.no_bias, dtype=args.dtype,
                           kv_heads=args.kv_heads, dropout=args.dropout, mlp=args.mlp, norm=args.norm,
                           positions=args.positions)
        profile = load_profile(args.profile)
        estimates = plan(shape, args.batch, args.ranks, args.ranks_per_node or args.ranks, profile,
                         max_micro_batch=args.max_micro_batch, schedules=args.schedules, shardings=args.sharding,
                         chunk_options=args.chunks, tp_sizes=args.tp, pp_sizes=args.pp, dp_sizes=args.dp,
                         micro_batches=args.micro_batch,
                         recompute=args.recompute, precision=_precision(args))
    except ValueError as exc:
        print(f"mpidist plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = to_json(estimates, args.top)
        out.update({"model": shape.__dict__, "profile": profile.name, "network": network_assumptions(profile),
                    "ranks": args.ranks,
                    "ranks_per_node": args.ranks_per_node or args.ranks, "global_batch": args.batch})
        print(json.dumps(out, indent=1))
    else:
        print(f"{shape.num_parameters() / 1e6:.1f}M parameters, {args.ranks} ranks "
              f"({args.ranks_per_node or args.ranks} per node), global batch {args.batch}, profile {profile.name}")
        if args.ranks > (args.ranks_per_node or args.ranks):
            print(network_assumptions(profile))
        print(format_table(estimates, args.top))
    if args.plot:
        try:
            plot(estimates, args.plot, min(args.top, 20), profile.memory_bytes)
        except ValueError as exc:
            print(f"mpidist plan: {exc}", file=sys.stderr)
            return 2
        print(f"mpidist plan: wrote {args.plot}", file=sys.stderr)
    return 0
