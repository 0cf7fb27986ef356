"""`harvest check-model MODEL`: capture a model in freeze mode and compare every point
with Hugging Face fp32 (engine/model_check.py does the work)."""

from __future__ import annotations


def cmd_check_model(args) -> int:
    """Exit 0 when every point is within tolerance of HF fp32; 1 when not, or when the engine
    refuses the trunk at load (docs/engine.md, "Supported model families")."""
    from ....engine.model_check import run_command

    from ...driver.prepare import resolve_model_path

    return run_command(resolve_model_path(args.model), args)


def add_parser(sub) -> None:
    cm = sub.add_parser("check-model", help="capture a model in freeze mode and compare every "
                        "layer with Hugging Face fp32; exit 1 above tolerance")
    cm.add_argument("model", help="checkpoint dir, hub name, smollm2 or tiny:<arch>")
    cm.add_argument("--points", nargs="*", help="default: resid_post at every layer; any point of "
                    "the table, at its own width (mlp_act.3, z.*, router_logits.* on MoE)")
    cm.add_argument("--lengths", default="5,37,150,64,90,17,1,120", help="prompt lengths")
    cm.add_argument("--tol-p50", type=float, default=0.03,
                    help="cap on the p50 bound; below it, each point's bound is a multiple "
                         "of HF's own engine-dtype-vs-fp32 gap there (engine.model_check.GAP_RATIO)")
    cm.add_argument("--tol-p99", type=float, default=0.15, help="cap on the p99 bound")
    cm.add_argument("--reference-device", default="cpu")
    cm.add_argument("--no-compile", action="store_true", help="skip torch.compile: starts in seconds")
    cm.add_argument("--unverified-trunk", action="store_true",
                    help="capture even if the block-semantics probe refuses the trunk")
    cm.add_argument("--json", action="store_true")
    cm.set_defaults(fn=cmd_check_model)
