"""Peak host memory (RSS) of `python -m train.export --format hf` against the model's size M.

    python -m bench.suite.export_memory [--layers 16] [--embd 1024] [--max-shard-size 100MB] [--json OUT] [--smoke]

The built-in GPT (by default 16 layers, 1024 wide, the built-in corpus' 64 tokens: 202M parameters, M = 0.75 GiB
in fp32) is trained one step under FSDP on 2 gloo ranks (python -m train.launch), which saves its checkpoint
(2 ranks' shards). Then train.export writes it as a Hugging Face folder of --max-shard-size files, in this
process: its peak RSS (VmHWM, reset first) above its RSS before the export is what the export holds. The start
is after the imports: torch, transformers, and the GPT-2 modeling module whose model the export builds on the
meta device to check the files against (about 130 MiB of code, printed, the same at any size). The export reads
one file's tensors at a time from the checkpoint, so it should hold about one file (and one stored chunk), not
M. Then transformers' from_pretrained loads the folder, and its logits are compared with the trained model's
(the checkpoint's, in the built-in GPT).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from bench.common import PY, SMOKE_QUIET, run, write_json

ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "BOOL": 1}


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """VmHWM back to the current RSS (Linux 4.0+), so that the peak is the export's, not the imports'."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--max-shard-size", default="100MB")
    p.add_argument("--smoke", action="store_true", help="seconds: a small model, 100KB files")
    p.add_argument("--json")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.embd, args.max_shard_size = 2, 64, "100KB"

    import torch
    import transformers  # noqa: F401  (imported before the export is measured, as train.export imports it)
    from safetensors import safe_open

    from train import config, export
    from train.checkpoint.dcp_io import read_state
    from train.parallel import wrapping

    torch.set_num_threads(1)
    sizes = [f"task.n_layer={args.layers}", f"task.n_embd={args.embd}", f"task.n_head={max(1, args.embd // 64)}",
             "task.seq_len=32", "task.train_tokens=4096", "task.eval_tokens=1024"]
    with tempfile.TemporaryDirectory(prefix="export-memory-") as d:
        run_dir, out = Path(d) / "run", Path(d) / "hf"
        t = time.time()
        run([PY, "-m", "train.launch", "--nproc-per-node=2", "--", "--config", "configs/gpt.yaml", *sizes,
             f"run.dir={run_dir}", "dist.strategy=fsdp", "optim.name=sgd", "optim.momentum=0", "optim.warmup_steps=0",
             "train.steps=1", "train.global_batch_size=2", "train.micro_batch_size=1", "train.eval_every=0",
             "train.precision=fp32", "checkpoint.every=1", "data.num_workers=0", *SMOKE_QUIET], timeout=3600)
        trained_s = time.time() - t

        imports = status_kib("VmRSS")  # what the export imports to build the model it checks against: code, a constant
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
        from huggingface_hub import split_torch_state_dict_into_shards  # noqa: F401

        before = status_kib("VmRSS")
        imports = before - imports
        reset = reset_peak()
        t = time.time()
        rc = export.main([str(run_dir), "--format", "hf", "--max-shard-size", args.max_shard_size, "--out", str(out)])
        export_s = time.time() - t
        peak = status_kib("VmHWM")
        if rc != 0:
            raise SystemExit(f"the export failed ({rc})")
        files = sorted(out.glob("*.safetensors"))
        largest = max(f.stat().st_size for f in files)
        model_bytes = 0  # M: the bytes of the model's tensors (fp32, as trained), from the files' headers
        for f in files:
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    s = h.get_slice(k)
                    model_bytes += math.prod(s.get_shape()) * ITEMSIZE[s.get_dtype()]
        increase = (peak - before) * 1024

        cfg = config.load("configs/gpt.yaml", sizes)
        task = cfg.task_class(cfg.task, cfg.seed)
        trained = wrapping.whole_model(task, torch.device("cpu"), cfg.seed).eval()
        ckpt = run_dir / "checkpoints"
        trained.load_state_dict(read_state(ckpt / (ckpt / "latest").read_text().strip(), keys=("model",))["model"])
        n = sum(p.numel() for p in trained.parameters())
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours = trained(tokens)[..., :64]
            del trained
            loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            theirs = loaded(tokens).logits
        diff = float((ours - theirs).abs().max())

    print(f"model: {n / 1e6:.0f}M parameters ({args.layers} layers, {args.embd} wide), M = {model_bytes / 2**20:.0f} "
          f"MiB; trained one step under FSDP on 2 gloo ranks in {trained_s:.0f} s")
    print(f"export to --max-shard-size {args.max_shard_size}: {len(files)} files (largest {largest / 2**20:.1f} MiB) "
          f"in {export_s:.1f} s")
    print(f"  peak RSS above the start: {increase / 2**20:.0f} MiB = {increase / model_bytes:.3f} M"
          f"{'' if reset else ' (VmHWM not reset: the imports count)'}; RSS before {before / 1024:.0f} MiB, peak "
          f"{peak / 1024:.0f} MiB")
    print(f"  (the start: after the imports of torch, transformers and its GPT-2 modeling, which the export's check "
          f"builds on meta: {imports / 1024:.0f} MiB of code, the same at any size)")
    print(f"  transformers' from_pretrained logits against the trained model's: max |difference| {diff:.2e}")
    if args.json:
        write_json(args.json, {"export_model_mib": model_bytes / 2**20, "export_peak_over_m": increase / model_bytes,
                               "export_peak_mib": increase / 2**20, "export_largest_file_mib": largest / 2**20,
                               "export_imports_mib": imports / 1024, "export_logits_equal": diff < 1e-4})


if __name__ == "__main__":
    main()
