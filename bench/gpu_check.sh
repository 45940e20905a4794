#!/usr/bin/env bash
# The checks that need a CUDA machine, in one go; prints one JSON line (last line of stdout).
#
#   bash bench/gpu_check.sh            # from the repository root, on a machine with a GPU
#
# 1. installs the package with the vllm and lora extras in its own virtual environment
#    (.venv-gpu: vLLM brings its CUDA torch; the CPU venv of .ci/setup stays as it is);
# 2. hf_bf16: the hf backend (bf16 on CUDA) against transformers' generate(), greedy, on the
#    embedded tiny model: the fraction of responses that are token for token the same, and
#    the tokens/s of each;
# 3. vllm_tests: tests/ops/engine/test_vllm_backend.py and tests/pipeline/tasks/test_vllm_tasks.py
#    (an elastic multi-turn run among them)
#    on the real engine (passed / failed counts);
# 4. nccl_update: one update on 2 ranks (FSDP2, NCCL, a LocalCluster of 2 workers, one GPU
#    each) against the same update on 1 rank: the largest gradient difference relative to
#    the gradient's scale. Needs 2 GPUs; with fewer it reports "skipped" and why.
# Never part of .ci/run. Log of each step: $OUT_DIR (default gpu_check_logs/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-gpu_check_logs}
VENV=${VENV:-.venv-gpu}
mkdir -p "$OUT_DIR"
export RLHFLESS_CACHE=${RLHFLESS_CACHE:-$PWD/$OUT_DIR/cache}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
    echo '{"bench": "gpu_check", "error": "no CUDA device (nvidia-smi failed)"}'
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || { echo '{"bench": "gpu_check", "error": "venv failed"}'; exit 1; }
fi
"$VENV/bin/python" -m pip install -q -U pip >"$OUT_DIR/install.log" 2>&1
if ! "$VENV/bin/python" -m pip install -q -e '.[dev,vllm,lora]' >>"$OUT_DIR/install.log" 2>&1; then
    echo "{\"bench\": \"gpu_check\", \"error\": \"install failed, see $OUT_DIR/install.log\"}"
    exit 1
fi
PY="$VENV/bin/python"

# ---- 2. hf backend in bf16 vs transformers generate() ----------------------------------
"$PY" - >"$OUT_DIR/hf_bf16.json" 2>"$OUT_DIR/hf_bf16.log" <<'EOF'
import json, time
import torch
from transformers import AutoTokenizer
from rlhfless.ops.engine.backend import HFBackend
from rlhfless.ops.engine.generate import SamplingParams
from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.toy.tinymodel import ensure_tiny_model

path = ensure_tiny_model(log=lambda *_: None)
engine = HFBackend(path, "cuda", 1)
engine.load()
engine.version = 0
tok = AutoTokenizer.from_pretrained(path)
prompts = read_prompts(path / "heldout.jsonl", tok).table.slice(0, 64)
params = SamplingParams(max_new_tokens=32, greedy=True)
torch.cuda.synchronize(); t = time.perf_counter()
table, _ = engine.generate(prompts, 1, params)
torch.cuda.synchronize(); ours_s = time.perf_counter() - t
ours = table.column("response_ids").to_pylist()
model = engine.model
same, theirs_tokens, theirs_s = 0, 0, 0.0
for ids, mine in zip(prompts.column("prompt_ids").to_pylist(), ours):
    x = torch.tensor([ids], device="cuda")
    torch.cuda.synchronize(); t = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32,
                         do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.cuda.synchronize(); theirs_s += time.perf_counter() - t
    ref = out[0, len(ids):].tolist()
    if tok.eos_token_id in ref:
        ref = ref[: ref.index(tok.eos_token_id) + 1]
    theirs_tokens += len(ref)
    same += ref == mine
print(json.dumps({"dtype": str(model.dtype), "prompts": len(ours),
                  "same_fraction": same / len(ours),
                  "ours_tokens_per_s": sum(map(len, ours)) / ours_s,
                  "generate_tokens_per_s": theirs_tokens / theirs_s}))
EOF
HF_RC=$?

# ---- 3. the vLLM backend's tests on the real engine -------------------------------------
RLHFLESS_REQUIRE_VLLM=1 "$PY" -m pytest -q -p no:cacheprovider tests/ops/engine/test_vllm_backend.py \
    tests/pipeline/tasks/test_vllm_tasks.py >"$OUT_DIR/vllm.log" 2>&1
VLLM_RC=$?

# ---- 4. a 2-rank NCCL update against 1 rank ----------------------------------------------
"$PY" - >"$OUT_DIR/nccl.json" 2>"$OUT_DIR/nccl.log" <<'EOF'
import json, sys
import torch
sys.path.insert(0, "tests/pipeline")  # the gradient test's batch and per-rank update
sys.path.insert(0, "tests")
if torch.cuda.device_count() < 2:
    print(json.dumps({"status": "skipped", "reason": f"{torch.cuda.device_count()} GPU(s): "
                      "NCCL needs one GPU per rank"}))
    raise SystemExit(0)
from distributed import Client, LocalCluster
from rlhfless.ops.toy.tinymodel import ensure_tiny_model
from rlhfless.pipeline.tasks.ranks import form_group, on_ranks
from rlhfless.pipeline.tasks.trainer import leave_trainer_task
import test_ranks as g

if __name__ == "__main__":
    path = str(ensure_tiny_model(log=lambda *_: None))
    table = g.trainable()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])
        single = client.submit(g.one_update, path, table, False, "cuda",
                               workers=[workers[0]], pure=False).result()["grads"]
        members = form_group(client, workers, workers, "cuda", "fsdp", leave_trainer_task)
        ranked = [r["grads"] for r in on_ranks(g.one_update, path, table, True, "cuda",
                                               client=client, members=members)]
    err = max((r[n] - single[n]).abs().max().item() / max(single[n].abs().max().item(), 1e-30)
              for r in ranked for n in single)
    print(json.dumps({"status": "ran", "ranks": 2, "max_grad_rel_err": err}))
EOF
NCCL_RC=$?

"$PY" - "$OUT_DIR" "$HF_RC" "$VLLM_RC" "$NCCL_RC" <<'EOF'
import json, re, sys
from pathlib import Path
out, hf_rc, vllm_rc, nccl_rc = Path(sys.argv[1]), *map(int, sys.argv[2:])
def result(name, rc):
    text = (out / name).read_text().strip() if (out / name).exists() else ""
    try:
        return json.loads(text.splitlines()[-1]) | {"rc": rc}
    except (ValueError, IndexError):
        return {"rc": rc, "error": f"no result, see {out}/{name.replace('.json', '.log')}"}
log = (out / "vllm.log").read_text()
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", log)}
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps({"bench": "gpu_check", "gpu": gpu,
                  "torch": torch.__version__, "hf_bf16": result("hf_bf16.json", hf_rc),
                  "vllm_tests": counts | {"rc": vllm_rc},
                  "nccl_update": result("nccl.json", nccl_rc)}))
EOF
