#!/usr/bin/env bash
# Peer comparison for docs/benchmarks.md: the same serving workload against
#   A  the kvscope engine            (kvscope engine, prefix cache off)
#   B  kvscope through the gateway   (kvscope gateway in front of A)
#   C  llama.cpp's native llama-server on the same SmolLM2 GGUF, one slot per client (-np C), prompt cache off
#  [D  llama-cpp-python's own server, opt-in: WITH_LLAMA_CPP_PYTHON=1; it serves one request at a time]
# for each concurrency C in $CONCURRENCIES, alternating A B C, B C A, C A B, … (`kvscope bench --compare`, the
# order rotated each round) for $ROUNDS rounds of $PROMPTS prompts: more, shorter rounds where a round is short,
# so the median of the per-round ratios holds still on a noisy machine (docs/benchmarks.md "Side by side"),
# then transformers `generate` on the same weights (bench/transformers_row.py, reusing engine/bench.py),
# and prints the markdown table (bench/peers_table.py). Before the servers start, the offline engine's idle TTFT
# of one $INPUT_LEN-token prompt (`kvscope bench --offline --step-bench`, 20 runs; SKIP_IDLE_TTFT=1 leaves it
# out), so that one run gives every figure of issue 13's targets on the same machine in the same hour.
#
# Usage (from the repo root, venv active):   bench/peers.sh
#   quick smoke run:                          CONCURRENCIES="1 2" PROMPTS="2 2" INPUT_LEN=32 OUTPUT_LEN=8 ROUNDS=1 bench/peers.sh
# Everything is configurable through the environment variables below. Results: $OUT_DIR/*.json, table.md,
# machine.txt and the server logs. Needs llama-server: built on first use by bench/build_llama_server.sh.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

MODEL="${MODEL:-smollm2-135m}"
CACHE="${KVSCOPE_CACHE:-$HOME/.cache/kvscope}"
GGUF="${GGUF:-$CACHE/models/$MODEL/SmolLM2-135M-Instruct.Q4_1.gguf}"
HF_DIR="${HF_DIR:-$CACHE/models/$MODEL/hf}"
PEERS_DIR="${PEERS_DIR:-/work/peers-build}"
LLAMA_SERVER="${LLAMA_SERVER:-$PEERS_DIR/llama.cpp-build/bin/llama-server}"
CONCURRENCIES="${CONCURRENCIES:-1 8 32}"
PROMPTS="${PROMPTS:-4 16 64}"            # prompts per run, one per concurrency
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
ROUNDS="${ROUNDS:-8 4 3}"                # rounds, one per concurrency (or one for all)
THREADS="${THREADS:-$(nproc)}"
LLAMA_THREADS="${LLAMA_THREADS:-$THREADS}"   # llama-server -t/-tb
DTYPE="${DTYPE:-auto}"                       # kvscope engine --dtype (auto|float32|bfloat16); auto = the servers' default
QUANTIZATION="${QUANTIZATION:-auto}"         # kvscope engine --quantization (auto|none|int8|int4|gguf); auto = the default format
ENGINE_PORT="${ENGINE_PORT:-18400}"
GATEWAY_PORT="${GATEWAY_PORT:-18401}"
LLAMA_PORT="${LLAMA_PORT:-18402}"
LCP_PORT="${LCP_PORT:-18403}"
WITH_LLAMA_CPP_PYTHON="${WITH_LLAMA_CPP_PYTHON:-0}"
SKIP_TRANSFORMERS="${SKIP_TRANSFORMERS:-0}"
SKIP_IDLE_TTFT="${SKIP_IDLE_TTFT:-0}"
OUT_DIR="${OUT_DIR:-$PEERS_DIR/results/$(date -u +%Y%m%dT%H%M%SZ)}"

read -r -a CONC <<<"$CONCURRENCIES"
read -r -a NPROMPTS <<<"$PROMPTS"
read -r -a NROUNDS <<<"$ROUNDS"
[[ ${#CONC[@]} -eq ${#NPROMPTS[@]} ]] || { echo "CONCURRENCIES and PROMPTS need as many entries" >&2; exit 2; }
if [[ ${#NROUNDS[@]} -eq 1 ]]; then
    for i in "${!CONC[@]}"; do NROUNDS[$i]="${NROUNDS[0]}"; done
fi
[[ ${#CONC[@]} -eq ${#NROUNDS[@]} ]] || { echo "ROUNDS needs one entry, or one per concurrency" >&2; exit 2; }
[[ -f "$GGUF" ]] || { echo "no GGUF at $GGUF (run: kvscope pull $MODEL)" >&2; exit 2; }
[[ -f "$HF_DIR/tokenizer.json" ]] || { echo "no converted model at $HF_DIR" >&2; exit 2; }
mkdir -p "$OUT_DIR"
echo "results → $OUT_DIR"

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_http() {  # URL TIMEOUT_S
    local deadline=$((SECONDS + $2))
    until curl -sf -o /dev/null "$1"; do
        ((SECONDS < deadline)) || { echo "timed out waiting for $1" >&2; return 1; }
        sleep 1
    done
}

stop() {  # PID: stop one process we started and wait for it
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}

# --- machine and versions ------------------------------------------------------------------------------------
"$REPO/bench/build_llama_server.sh" "$PEERS_DIR"
{
    echo "date: $(date -u +%FT%TZ)"
    lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))'
    echo "cpu flags: $(grep -o -w -E 'avx512f|avx512_bf16|avx512_vnni|amx_tile|amx_bf16|amx_int8' /proc/cpuinfo \
        | sort -u | tr '\n' ' ')"
    grep MemTotal /proc/meminfo
    echo "kernel: $(uname -r)"
    echo "python: $(python -c 'import sys; print(sys.version.split()[0])')"
    echo "torch: $(python -c 'import torch; print(torch.__version__, torch.get_num_threads(), "threads")')"
    echo "transformers: $(python -c 'import transformers; print(transformers.__version__)')"
    echo "llama-server: $("$LLAMA_SERVER" --version 2>&1 | tr '\n' ' ')"
    echo "gguf: $GGUF ($(sha256sum "$GGUF" | cut -c1-16)…)"
    echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "llama-bench (raw llama.cpp speed on this machine now; pp = prefill, tg = decode, tokens/s):"
    "$(dirname "$LLAMA_SERVER")/llama-bench" -m "$GGUF" -t "$THREADS" -p "$INPUT_LEN" -n 64 -r 2 -o md 2>/dev/null \
        | grep -E '^\|' || echo "(llama-bench failed)"
} >"$OUT_DIR/machine.txt"
cat "$OUT_DIR/machine.txt"
# llama.cpp's threads meet at spin barriers: with -t = all cores, any other busy process slows it ~10x
if awk '{exit !($1 > 0.5)}' /proc/loadavg; then
    echo "WARNING: 1-min load average $(cut -d' ' -f1 /proc/loadavg) > 0.5: the machine is not quiet;" \
        "llama.cpp's numbers collapse under contention (see docs/benchmarks.md)" | tee -a "$OUT_DIR/machine.txt" >&2
fi

# --- idle TTFT: the offline engine alone, nothing else running -----------------------------------------------
if [[ "$SKIP_IDLE_TTFT" != 1 ]]; then
    kvscope bench --offline --step-bench --model "$MODEL" --dtype "$DTYPE" --quantization "$QUANTIZATION" \
        --concurrency 1 --num-threads "$THREADS" --input-len "$INPUT_LEN" --ttft-runs 20 \
        --save-result "$OUT_DIR/idle-ttft.json" 2>"$OUT_DIR/idle-ttft.log" | tee "$OUT_DIR/idle-ttft.txt"
fi

# --- kvscope engine and gateway (up for the whole run) ---------------------------------------------------------
kvscope engine --model "$MODEL" --port "$ENGINE_PORT" --max-model-len 1024 --no-prefix-caching \
    --num-threads "$THREADS" --dtype "$DTYPE" --quantization "$QUANTIZATION" >"$OUT_DIR/engine.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$ENGINE_PORT/health" 300
echo "kvscope engine: --dtype $DTYPE --quantization $QUANTIZATION; $(grep -m1 "weights format:" "$OUT_DIR/engine.log" \
    | sed 's/.*weights format: /weights format: /' | cut -c1-400)" >>"$OUT_DIR/machine.txt"
kvscope gateway --upstream "http://127.0.0.1:$ENGINE_PORT" --port "$GATEWAY_PORT" \
    --tokenizer "$MODEL=$HF_DIR" --log-file "$OUT_DIR/gateway-requests.jsonl" >"$OUT_DIR/gateway.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$GATEWAY_PORT/readyz" 60

# --- optional: llama-cpp-python's server in its own venv ---------------------------------------------------------
LCP_ARGS=()
if [[ "$WITH_LLAMA_CPP_PYTHON" == 1 ]]; then
    LCP_VENV="$PEERS_DIR/lcp-venv"
    if [[ ! -x "$LCP_VENV/bin/python" ]] || ! "$LCP_VENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then
        python -m venv "$LCP_VENV"
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
            nice -n 19 "$LCP_VENV/bin/pip" install "llama-cpp-python[server]==${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
    fi
    "$LCP_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias "$MODEL" --host 127.0.0.1 \
        --port "$LCP_PORT" --n_threads "$THREADS" --n_threads_batch "$THREADS" --n_ctx 1024 \
        --interrupt_requests False >"$OUT_DIR/llama-cpp-python.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$LCP_PORT/v1/models" 120
    LCP_ARGS=(--compare "http://127.0.0.1:$LCP_PORT" --label "llama-cpp-python server")
fi

# --- one alternating comparison per concurrency; llama-server restarted with -np C ------------------------------
for i in "${!CONC[@]}"; do
    c="${CONC[$i]}"
    "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" --alias "$MODEL" -t "$LLAMA_THREADS" \
        -tb "$LLAMA_THREADS" -np "$c" -c $((c * 512)) --no-cache-prompt --no-webui >"$OUT_DIR/llama-server-c$c.log" 2>&1 &
    LLAMA_PID=$!
    PIDS+=("$LLAMA_PID")
    wait_http "http://127.0.0.1:$LLAMA_PORT/health" 120
    echo "load average before concurrency $c: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT_DIR/machine.txt"
    echo "=== concurrency $c: ${NPROMPTS[$i]} prompts × ${NROUNDS[$i]} rounds ==="
    kvscope bench --base-url "http://127.0.0.1:$ENGINE_PORT" --model "$MODEL" --tokenizer "$HF_DIR" \
        --compare "http://127.0.0.1:$GATEWAY_PORT" --compare "http://127.0.0.1:$LLAMA_PORT" \
        --label "kvscope engine" --label "kvscope gateway" --label "llama.cpp server" "${LCP_ARGS[@]}" \
        --compare-rounds "${NROUNDS[$i]}" --endpoint completions --dataset random --input-len "$INPUT_LEN" \
        --output-len "$OUTPUT_LEN" --ignore-eos --temperature 0 --max-concurrency "$c" \
        --num-prompts "${NPROMPTS[$i]}" --seed 0 --extra-body '{"cache_prompt": false}' --disable-tqdm \
        --save-result "$OUT_DIR/serve-c$c.json" | tee "$OUT_DIR/serve-c$c.txt"
    stop "$LLAMA_PID"
done
cleanup
PIDS=()

# --- transformers generate (static batch = concurrency), servers stopped -----------------------------------------
if [[ "$SKIP_TRANSFORMERS" != 1 ]]; then
    python bench/transformers_row.py --model-dir "$HF_DIR" --concurrency "${CONC[@]}" --input-len "$INPUT_LEN" \
        --output-len "$OUTPUT_LEN" --dtype "${DTYPE/auto/float32}" --rounds "${NROUNDS[-1]}" --save-result "$OUT_DIR/transformers.json" \
        | tee "$OUT_DIR/transformers.txt"
fi

echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT_DIR/machine.txt"
python bench/peers_table.py "$OUT_DIR" | tee "$OUT_DIR/table.md"
