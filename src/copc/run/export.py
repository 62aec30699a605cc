"""``copc export`` and ``copc convert-gguf``: get a policy out of copc, or a GGUF model into it.

    copc export RUN_DIR OUT [--step N]      # a run's checkpoint -> an HF folder (weights, tokenizer,
    template) copc convert-gguf DIR FILE.gguf OUT     # a GGUF model -> an HF folder copc train can start from
    copc make-critic POLICY_DIR OUT --layers K   # the policy's first K layers: a smaller critic
    (model.critic=OUT)

``export`` writes an ordinary ``save_pretrained`` folder: ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)`` load it with no copc installed. The chat template the run trained
with travels with the tokenizer (``rollout.chat_template``: the tokenizer's own for ``auto``, the file's
text for a file, none for ``none``), and ``copc_export.json`` says where the weights came from (run,
step, method, task). It takes the newest checkpoint that verifies (a damaged one is named and passed
over, as ``copc eval`` does) or ``--step N``. ``OUT`` must not exist or be empty: nothing is overwritten.
The critic is not exported (it is a training aid; a run's checkpoint keeps it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc.config import CommandParser, ConfigError, load_yaml
from copc.models.hf import convert_gguf, load_policy, save_first_layers
from copc.run.build import policy_path, quiet_transformers
from copc.run.config import RunConfig
from copc.run.readers import checkpoint_phrase, partial_checkpoint_notes, run_state
from copc.trainer.checkpoint import (
    CheckpointError,
    checkpoint_root,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    step_dir_name,
)

__all__ = ["convert_cli", "critic_cli", "export_cli", "export_run", "load_run_policy"]

#: What ``copc export`` writes beside the weights: where they came from.
EXPORT_META = "copc_export.json"


def load_run_policy(
    run_dir: Path, *, step: int | None = None, on_skip: Callable[[str], None] | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, int]:
    """The policy of run ``run_dir`` at its newest checkpoint that verifies (``step=None``) or at ``step``.

    Each checkpoint passed over (damaged: sizes or sha256 do not match) is given to ``on_skip`` with the
    reason. Fails in one line (ValueError) when the run has no checkpoint, none verifies, or ``step`` has
    none.
    """
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a copc run directory (no config.yaml); give the run_dir of a "
                         f"copc train run")
    steps = list_checkpoints(run_dir)
    if not steps:
        raise ValueError(f"run directory {run_dir} has no checkpoint yet; wait for one (checkpoint_every), "
                         f"or continue the run with copc train resume=true run_dir={run_dir}")
    if step is None:
        latest = load_latest(run_dir, on_skip=on_skip)
        if latest is None:
            raise ValueError(f"every checkpoint under {checkpoint_root(run_dir)} is damaged; nothing to load")
        step, payload = latest
    else:
        if step not in steps:
            raise ValueError(f"run {run_dir} has no checkpoint of step {step}; it has steps "
                             f"{', '.join(map(str, steps))}")
        payload = load_checkpoint(checkpoint_root(run_dir) / step_dir_name(step))
    cfg = load_yaml(RunConfig, run_dir / "config.yaml")
    model, tokenizer = load_policy(policy_path(cfg, run_dir))
    model.load_state_dict(payload["trainer"]["policy"])  # type: ignore[index]
    return model, tokenizer, step


def _template_of(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The chat template the run rendered prompts with (None: raw text)."""
    setting = cfg.rollout.chat_template
    if setting == "none":
        return None
    if setting == "auto":
        template = tokenizer.chat_template
        return None if not template else template if isinstance(template, str) else template.get("default")
    return Path(setting).expanduser().read_text()


def export_run(run_dir: Path, out: Path, *, step: int | None = None,
               on_skip: Callable[[str], None] | None = None) -> tuple[Path, int]:
    """Write run ``run_dir``'s policy (newest verifying checkpoint, or ``step``) to the HF folder ``out``.

    Returns ``(out, step)``. ``out`` must be missing or empty (ValueError otherwise, before anything loads).
    """
    refusal = _new_folder(out)
    if refusal is not None:
        raise ValueError(refusal)
    model, tokenizer, step = load_run_policy(run_dir, step=step, on_skip=on_skip)
    cfg = load_yaml(RunConfig, run_dir / "config.yaml")
    tokenizer.chat_template = _template_of(cfg, tokenizer)
    tmp = out.with_name(f".{out.name}.partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {"run_dir": str(run_dir.absolute()), "step": step, "method": cfg.method, "task": cfg.task,
            "chat_template": cfg.rollout.chat_template}
    (tmp / EXPORT_META).write_text(json.dumps(meta, indent=1) + "\n")
    if out.exists():
        out.rmdir()  # empty, checked above
    tmp.rename(out)
    return out, step


def export_cli(argv: Sequence[str]) -> int:
    """``copc export RUN_DIR OUT [--step N]`` (module docstring)."""
    parser = CommandParser(prog="copc export", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a copc train run directory")
    parser.add_argument("out", help="a new (or empty) folder for the HF model")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint's step (default: the newest that verifies)")
    args = parser.parse_args(list(argv))
    quiet_transformers()
    run_dir, skipped = Path(args.run_dir), []

    def on_skip(reason: str) -> None:
        skipped.append(reason)
        print(f"warning: skipped {reason}", file=sys.stderr, flush=True)

    try:
        out, step = export_run(run_dir, Path(args.out), step=args.step, on_skip=on_skip)
    # --step N damaged: no fallback asked for
    except (ConfigError, ValueError, OSError, CheckpointError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    for note in partial_checkpoint_notes(run_dir):
        print(note, file=sys.stderr, flush=True)
    which = "" if args.step is not None else f" ({checkpoint_phrase(run_dir, step, skipped)}; the run is " \
        f"{run_state(run_dir)})"
    print(f"exported the policy of {args.run_dir} at step {step}{which} to {out} "
          f"(load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def convert_cli(argv: Sequence[str]) -> int:
    """``copc convert-gguf DIR FILE.gguf OUT``: de-quantize a GGUF model to an HF folder (needs ``gguf``)."""
    parser = CommandParser(prog="copc convert-gguf",
                           description="Convert DIR/FILE.gguf to an HF folder OUT (float32) with its "
                           "tokenizer and chat template, for model.policy=OUT.")
    parser.add_argument("folder", help="the folder holding the GGUF file")
    parser.add_argument("gguf_file", help="the GGUF file's name inside the folder")
    parser.add_argument("out", help="a new (or empty) folder")
    args = parser.parse_args(list(argv))
    out = Path(args.out)
    refusal = _new_folder(out)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if not (Path(args.folder) / args.gguf_file).is_file():
        print(f"error: {Path(args.folder) / args.gguf_file} does not exist; give the folder and the file's "
              f"name in it",
              file=sys.stderr)
        return 2
    quiet_transformers()
    try:
        convert_gguf(args.folder, args.gguf_file, out)
    except (ImportError, OSError, RuntimeError, ValueError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"converted {args.gguf_file} to {out} (use model.policy={out})")
    return 0


def _new_folder(out: Path) -> str | None:
    """None if ``out`` may be written (missing or empty), else the one-line refusal."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return f"{out} exists and is not an empty folder; give a new folder (nothing is overwritten)"
    return None


def critic_cli(argv: Sequence[str]) -> int:
    """``copc make-critic POLICY_DIR OUT --layers K``: a K-layer critic backbone cut from the policy."""
    parser = CommandParser(
        prog="copc make-critic",
        description="Save the first K decoder layers of the HF policy in POLICY_DIR (with its embeddings, "
        "final norm and tokenizer) to OUT, for model.critic=OUT: a critic sharing the policy's tokenizer "
        "that costs about K/L of the policy's memory and compute (L = the policy's layers).",
    )
    parser.add_argument("policy", help="an HF model folder (e.g. the one model.policy names)")
    parser.add_argument("out", help="a new (or empty) folder")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers kept (1 .. L-1)")
    args = parser.parse_args(list(argv))
    refusal = _new_folder(Path(args.out))
    if refusal is None and not (Path(args.policy) / "config.json").is_file():
        refusal = (f"{args.policy} is not an HF model folder (no config.json); give the folder "
                   "model.policy names")
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    quiet_transformers()
    try:
        out = save_first_layers(args.policy, args.layers, args.out)
    except (OSError, RuntimeError, ValueError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"saved the first {args.layers} layers of {args.policy} to {out} (use model.critic={out})")
    return 0
