#!/usr/bin/env bash
# The suite invocations of the 2026-12-01 GPU sessions that filled gaps of issues 12 and 13 (evaluation/RESULTS.md);
# each PART is one `hf-sparse-kv suite` call with --set overrides. Carried to the device as .stage/extras/gaps.sh.
# usage: gaps.sh RESULTS_DIR PART TIME_LIMIT [suite args...]   (run from the repository root on the device)
set -u
R=$1; PART=$2; T=$3; shift 3
O='{name: oracle_block_topk, label: oracle, sink: 4, window: 32}'
QU='{name: quest, sink: 4, window: 32}'
Q4='{name: quant_block_topk, label: quant4, sink: 4, window: 32, bits: 4}'
TT='{name: token_topk, label: token_topk, sink: 4, window: 32}'
BT='{name: block_topk, sink: 4, window: 32}'
SW='{name: sink_window, sink: 4}'
SK='{name: snapkv, sink: 4, window: 32, observe: 32}'
SQ="{name: snapkv, label: snapkv1/4+quest, budget: \"1/4\", sink: 4, window: 32, observe: 32, then: $QU}"
# Qwen2.5's multi-value needles (4 values of one key, 32 new tokens) and its QA, at 32K, 8 trials a batch
MV32='needle={trials: 0, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {32768: 8}, hard: {variants: [multi_value], trials: 100, n_needles: 8, multi_value: {n_needles: 4, new_tokens: 32}}}'
QA32='qa={tasks: [variable_tracking, fact, common_words], items: 100, lengths: [32768], new_tokens: 8, batch: {32768: 8}}'
CH='name: "evaluation.channel_quant:ChannelQuantBlockTopK", sink: 4, window: 32, bits: 4, rest: block'
run() { ${PY:-python3} -m evaluation.cli suite "$@" --time-limit "$T"; }
# issue 13's target cells of model $1 at 1/16: L (lengths), N (single + multi-key needles), QA (Qwen2.5's at 32K)
targets() {
  local nd='trials: 100, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000'
  case $1 in
    smollm2) L='[4096, 8192]'; QA='qa=null'; N="needle={$nd, batch: 16, hard: {variants: [multi_key], trials: 100, n_needles: 4}}" ;;
    qwen2.5) L='[32768]'; QA=$QA32; N="needle={$nd, batch: {32768: 8}, hard: {variants: [multi_key], trials: 100, n_needles: 8}}" ;;
    *) L='[32768]'; QA='qa=null'; N="needle={$nd, batch: {32768: 4}, hard: {variants: [multi_key], trials: 100, n_needles: 4}}" ;;
  esac
}
# the asset name of suite $1's model (recipes/suite_<model>.yaml)
model_of() { case $1 in gemma3) echo gemma3-270m ;; qwen2.5) echo qwen2.5-coder-1.5b ;; *) echo "$1" ;; esac; }
# issue 13's experiment on model $1's target cells: policies $2 beside dense, the oracle, Quest and quant4, their
# labels $3 run first; the rest of the arguments go to the suite
run_targets() {
  local m=$1 extra=$2 labels=$3
  shift 3
  targets "$m"
  run "$m" --out "$R" --set "lengths=$L" --set 'budgets=["1/16"]' \
    --set "policies=[{name: dense}, $O, $QU, $Q4, $extra]" \
    --set "decisive={policies: [dense, oracle, $labels, quest, quant4], budgets: [\"1/16\"]}" \
    --set "$N" --set "$QA" "$@"
}
case $PART in
  qwen_channels)  # issue 13: a quarter of the channels (r = 32 of D = 128) at 32K, 1/16: ppl, single + multi-key needles
    C1="{$CH, label: chq4_quarter_block, channels: 32}"; C4="{$CH, label: chq4_quarter_block_g4, channels: 32, group: 4}"
    run qwen2.5 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, $O, $Q4, $C1, $C4]" \
      --set 'decisive={policies: [dense, oracle, quant4, chq4_quarter_block, chq4_quarter_block_g4], budgets: ["1/16"]}' \
      --set 'needle={trials: 100, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {32768: 8}, hard: {variants: [multi_key], trials: 100, n_needles: 8}}' \
      --set 'qa=null' "$@" ;;
  qwen_needles_short)  # issue 12: Qwen2.5's needles at 8K and 16K (single, multi-key), 1/16
    run qwen2.5 --out "$R" --set 'lengths=[8192, 16384]' --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, $O, $QU, $Q4, $TT]" \
      --set 'decisive={policies: [dense, oracle, quest, quant4, token_topk], budgets: ["1/16"]}' \
      --set 'needle={trials: 100, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {8192: 16, 16384: 8}, hard: {variants: [multi_key], trials: 100, n_needles: 8}}' \
      --set 'qa=null' "$@" ;;
  qwen_ppl_rest)  # issue 12: BlockTopK, SinkWindow, SnapKV, SnapKV 1/4 + Quest perplexity at 1/16 (no needles)
    run qwen2.5 --out "$R" --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, {name: block_topk, sink: 4, window: 32}, {name: sink_window, sink: 4}, {name: snapkv, sink: 4, window: 32, observe: 32}, {name: snapkv, label: snapkv1/4+quest, budget: \"1/4\", sink: 4, window: 32, observe: 32, then: $QU}]" \
      --set 'decisive={policies: [dense], budgets: ["1/16"]}' --set 'needle={trials: 0}' --set 'qa=null' "$@" ;;
  gemma_channels)  # issue 13: a quarter of the channels (r = 64 of D = 256) at 32K, 1/16: ppl, single needle
    C1="{$CH, label: chq4_quarter_block, channels: 64}"; C4="{$CH, label: chq4_quarter_block_g4, channels: 64, group: 4}"
    run gemma3 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, $O, $Q4, $C1, $C4]" \
      --set 'decisive={policies: [dense, oracle, quant4, chq4_quarter_block, chq4_quarter_block_g4], budgets: ["1/16"]}' \
      --set 'needle={trials: 100, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {32768: 4}}' \
      --set 'qa=null' "$@" ;;
  reuse_*)  # issue 13: a selection reused for r decode steps (simulated: perplexity + fidelity only), 1/16, every length
    M=${PART#reuse_}
    RU=""
    for r in 2 4 8 16; do
      RU="$RU, {name: oracle_block_topk, label: oracle_r$r, sink: 4, window: 32, reuse: $r}"
      RU="$RU, {name: quant_block_topk, label: quant4_r$r, sink: 4, window: 32, bits: 4, reuse: $r}"
    done
    RU="$RU, {name: quant_block_topk, label: quant2_r4, sink: 4, window: 32, bits: 2, reuse: 4}"
    RU="$RU, {name: quest, label: quest_r4, sink: 4, window: 32, reuse: 4}"
    run "$M" --out "$R" --set 'budgets=["1/16"]' --set "policies=[{name: dense}, $O, $Q4, $QU$RU]" \
      --set 'decisive={policies: [dense], budgets: ["1/16"]}' --set 'needle={trials: 0}' --set 'qa=null' "$@" ;;
  qwen_multikey_budgets)  # issue 12: Qwen2.5's 8-key needles at 32K at 1/8 and 1/32 (the oracle, Quest, quant4)
    run qwen2.5 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/8", "1/32"]' \
      --set "policies=[{name: dense}, $O, $QU, $Q4]" \
      --set 'decisive={policies: [dense, oracle, quest, quant4], budgets: ["1/32"]}' \
      --set 'needle={trials: 0, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {32768: 8}, hard: {variants: [multi_key], trials: 100, n_needles: 8}}' \
      --set 'perplexity={windows: 0}' --set 'qa=null' "$@" ;;
  qwen_single_budgets)  # issue 12: Qwen2.5's single needle at 32K at 1/8 and 1/32 (the oracle, Quest, quant4)
    run qwen2.5 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/8", "1/32"]' \
      --set "policies=[{name: dense}, $O, $QU, $Q4]" \
      --set 'decisive={policies: [dense, oracle, quest, quant4], budgets: ["1/32"]}' \
      --set 'needle={trials: 100, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {32768: 8}, hard: {variants: []}}' \
      --set 'perplexity={windows: 0}' --set 'qa=null' "$@" ;;
  gemma_snapkv)  # issue 12: SnapKV and SnapKV 1/4 + Quest on Gemma-3 (its global layers), 1/16: ppl (decode way), single needle
    run gemma3 --out "$R" --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, {name: snapkv, sink: 4, window: 32, observe: 32}, {name: snapkv, label: snapkv1/4+quest, budget: \"1/4\", sink: 4, window: 32, observe: 32, then: $QU}]" \
      --set 'decisive={policies: [dense], budgets: ["1/16"]}' \
      --set 'needle={trials: 100, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {16384: 8, 32768: 4}, hard: {variants: []}}' \
      --set 'qa=null' "$@" ;;
  gemma_single_budgets)  # issue 12: Gemma-3's single needle at 32K at 1/8 and 1/32 (the oracle, Quest, quant4)
    run gemma3 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/8", "1/32"]' \
      --set "policies=[{name: dense}, $O, $QU, $Q4]" \
      --set 'decisive={policies: [dense, oracle, quest, quant4], budgets: ["1/32"]}' \
      --set 'needle={trials: 100, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {32768: 4}, hard: {variants: []}}' \
      --set 'perplexity={windows: 0}' --set 'qa=null' "$@" ;;
  qwen_token_budgets)  # issue 12: TokenTopK's perplexity on Qwen2.5 at 8K and 16K at 1/8 and 1/32 (dense, the oracle beside it)
    run qwen2.5 --out "$R" --set 'lengths=[8192, 16384]' --set 'budgets=["1/8", "1/32"]' \
      --set "policies=[{name: dense}, $O, $TT]" \
      --set 'decisive={policies: [dense, oracle, token_topk], budgets: ["1/8", "1/32"]}' \
      --set 'needle={trials: 0}' --set 'qa=null' "$@" ;;
  smollm2_budgets_rest)  # issue 12: SmolLM2's TokenTopK, BlockTopK, SinkWindow, SnapKV (+ Quest) perplexity at 1/8 and 1/32
    run smollm2 --out "$R" --set 'budgets=["1/8", "1/32"]' \
      --set "policies=[{name: dense}, $TT, {name: block_topk, sink: 4, window: 32}, {name: sink_window, sink: 4}, {name: snapkv, sink: 4, window: 32, observe: 32}, {name: snapkv, label: snapkv1/4+quest, budget: \"1/4\", sink: 4, window: 32, observe: 32, then: $QU}]" \
      --set 'decisive={policies: [dense], budgets: ["1/8"]}' --set 'needle={trials: 0}' --set 'qa=null' "$@" ;;
  moments_*)  # issue 13: blocks ranked by the mass their keys' mean and variance predict (evaluation/moments.py), 1/16
    M=${PART#moments_}
    case $M in smollm2) L='[4096, 8192]' ;; *) L='[32768]' ;; esac
    MO='name: "evaluation.moments:MomentBlockTopK", sink: 4, window: 32'
    run "$M" --out "$R" --set "lengths=$L" --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, $O, $QU, {$MO, label: moments_gauss, estimate: gauss}, {$MO, label: moments_mean, estimate: mean}]" \
      --set 'decisive={policies: [dense], budgets: ["1/16"]}' --set 'needle={trials: 0}' --set 'qa=null' "$@" ;;
  progressive_*)  # issue 13: 2-bit keys as bit planes (evaluation/compact_grid.py, reference ops), c = 4 and 2, at 1/16
    # on issue 13's target cells: SmolLM2 4K + 8K, Gemma-3 32K, Qwen2.5 32K (+ its QA); ppl, single + multi-key needles
    PG='name: "evaluation.compact_grid:ProgressiveGridBlockTopK", sink: 4, window: 32, bits: 2, group: 32, meta: fp8'
    PGS="{$PG, label: pg2_g32_fp8_c4, candidates: 4}, {$PG, label: pg2_g32_fp8_c2, candidates: 2}"
    run_targets "${PART#progressive_}" "$PGS" "pg2_g32_fp8_c4, pg2_g32_fp8_c2" "$@" ;;
  fp8_*)  # issue 13: the library's Fp8BlockTopK (float8 e4m3 keys over a scale a key, the oracle's mass on them) at
    # 1/16 on issue 13's target cells, beside dense, the oracle, Quest and quant4 on the same windows and trials
    run_targets "${PART#fp8_}" "{name: fp8_block_topk, label: fp8, sink: 4, window: 32}" "fp8" "$@" ;;
  pq_exact_*)  # the pq_* part's cells of pq8_c2_exact alone (its quant4 twin matched it where both ran, 2026-12-04)
    PQ='name: "evaluation.product_quant:ProductQuantBlockTopK", sink: 4, window: 32, fine: exact'
    run_targets "${PART#pq_exact_}" "{$PQ, label: pq8_c2_exact, sub_dim: 8, candidates: 2}" "pq8_c2_exact" "$@" ;;
  pq_wide_*)  # product-quantized keys with more candidates (c = 4) or finer pieces (4 channels, 1/8 of K), exact fine
    PQ='name: "evaluation.product_quant:ProductQuantBlockTopK", sink: 4, window: 32, fine: exact'
    PQS="{$PQ, label: pq8_c4_exact, sub_dim: 8, candidates: 4}, {$PQ, label: pq4_c2_exact, sub_dim: 4, candidates: 2}"
    run_targets "${PART#pq_wide_}" "$PQS" "pq8_c4_exact, pq4_c2_exact" "$@" ;;
  pq_lib_*)  # issue 13: the library's coarse="pq" (TopPBlockTopK, c = 4, p = 1: the oracle's criterion on the
    # candidates) with centres calibrated once, on the KJV's first L tokens (L: the longest length served; the suite's
    # windows alternate essays and KJV, so half of them share text with the calibration), on the target cells
    M=${PART#pq_lib_}
    case $M in smollm2) CT=8192 ;; *) CT=32768 ;; esac
    A=${HF_SPARSE_KV_ASSETS:-/root/hfsk_assets}
    CAL=$A/pq_$M.pt
    [ -f "$CAL" ] || ${PY:-python3} -m evaluation.cli calibrate-selector --model "$(model_of "$M")" --method pq \
      --text "$A/kjv.txt" --tokens "$CT" --out "$CAL" || exit 1
    PL="{name: top_p_block_topk, label: pq8_c4_cal, sink: 4, window: 32, candidates: 4, p: 1.0, pool: heads, coarse: pq, calibration: \"$CAL\"}"
    run_targets "$M" "$PL" "pq8_c4_cal" "$@" ;;
  pq_fit_*)  # issue 13: the library's coarse="pq" as pq_lib_ (c = 4, p = 1), its centres fitted on each prompt's keys at
    # its prefill (calibration="prefill": no file; the suite's simulate way fits them on each chunk's stored keys)
    # (its cells of 2026-12-04 ~12:00 UTC ran the float32 table, the default then; bfloat16 is the default now)
    PL="{name: top_p_block_topk, label: pq8_c4_prefill, sink: 4, window: 32, candidates: 4, p: 1.0, pool: heads, coarse: pq, calibration: {method: pq, fit: prefill, table: float32}}"
    run_targets "${PART#pq_fit_}" "$PL" "pq8_c4_prefill" "$@" ;;
  pq_bf16_*)  # issue 13: pq_fit_'s selector with its scoring table in bfloat16 (its kernel 30-34 % faster on the H200),
    # on the cells and trials of pq8_c4_prefill (the float32 table), for a paired comparison
    PB="{name: top_p_block_topk, label: pq8_c4_prefill_bf16, sink: 4, window: 32, candidates: 4, p: 1.0, pool: heads, coarse: pq, calibration: {method: pq, fit: prefill, table: bfloat16}}"
    run_targets "${PART#pq_bf16_}" "$PB" "pq8_c4_prefill_bf16" "$@" ;;
  pq16_*)  # issue 13: pq_bf16_'s selector on 16-channel pieces (half the codes and half the kernel's table gathers;
    # the CPU screen: hit rate 0.005 under 8-channel pieces on SmolLM2, 0.018 on Gemma-3), on the same cells
    P16="{name: top_p_block_topk, label: pq16_c4_prefill_bf16, sink: 4, window: 32, candidates: 4, p: 1.0, pool: heads, coarse: pq, calibration: {method: pq, fit: prefill, sub_dim: 16, centroids: 256, table: bfloat16}}"
    run_targets "${PART#pq16_}" "$P16" "pq16_c4_prefill_bf16" "$@" ;;
  pq_*)  # issue 13: product-quantized keys as the coarse pass (evaluation/product_quant.py, reference ops), c = 2,
    # the fine pass the candidates' own keys or their 4-bit codes, at 1/16 on the target cells (as progressive_*)
    PQ='name: "evaluation.product_quant:ProductQuantBlockTopK", sink: 4, window: 32, sub_dim: 8, centroids: 256, candidates: 2'
    PQS="{$PQ, label: pq8_c2_exact, fine: exact}, {$PQ, label: pq8_c2_quant4, fine: quant4}"
    run_targets "${PART#pq_}" "$PQS" "pq8_c2_exact, pq8_c2_quant4" "$@" ;;
  qwen_multivalue_budgets)  # issue 12: Qwen2.5's multi-value needles at 32K at 1/8 and 1/32, TokenTopK's at 1/16
    run qwen2.5 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/8", "1/16", "1/32"]' \
      --set "policies=[{name: dense}, $O, $QU, $Q4, $TT]" \
      --set 'decisive={policies: [dense, oracle, quest, quant4, token_topk], budgets: ["1/8", "1/16", "1/32"]}' \
      --set "$MV32" \
      --set 'perplexity={windows: 0}' --set 'qa=null' "$@" ;;
  qwen_qa_budgets)  # issue 12: Qwen2.5's QA at 32K at 1/8 (the oracle, Quest, quant4, TokenTopK), then 1/32
    run qwen2.5 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/8", "1/32"]' \
      --set "policies=[{name: dense}, $O, $QU, $Q4, $TT]" \
      --set 'decisive={policies: [dense, oracle, quest, quant4, token_topk], budgets: ["1/8"]}' \
      --set 'needle={trials: 0}' --set 'perplexity={windows: 0}' \
      --set "$QA32" "$@" ;;
  smollm2_grid)  # issue 12: SmolLM2's needles (single, 4-key) for issue 12's eight policies at 1/8, 1/16, 1/32 (resumes)
    run smollm2 --out "$R" --set "policies=[{name: dense}, $O, $QU, $TT, $BT, $SW, $SK, $SQ]" \
      --set 'decisive={policies: [dense, oracle, quest, token_topk, block_topk, sink_window, snapkv, snapkv1/4+quest], budgets: ["1/16"]}' \
      --set 'perplexity={windows: 0}' --set 'qa=null' "$@" ;;
  qwen_rest_1_16)  # issue 12: Qwen2.5's multi-value needles and QA at 32K, 1/16, for BlockTopK and SinkWindow
    run qwen2.5 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, $BT, $SW]" \
      --set 'decisive={policies: [dense, block_topk, sink_window], budgets: ["1/16"]}' \
      --set "$MV32" \
      --set 'perplexity={windows: 0}' \
      --set "$QA32" "$@" ;;
  qwen_mv_short)  # issue 12: Qwen2.5's multi-value needles at 8K and 16K, 1/16 (every policy but SnapKV)
    run qwen2.5 --out "$R" --set 'lengths=[8192, 16384]' --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, $O, $QU, $Q4, $TT, $BT, $SW]" \
      --set 'decisive={policies: [dense, oracle, quest, quant4, token_topk, block_topk, sink_window], budgets: ["1/16"]}' \
      --set 'needle={trials: 0, depths: [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], new_tokens: 8, max_offset: 40000, batch: {8192: 16, 16384: 8}, hard: {variants: [multi_value], trials: 100, n_needles: 8, multi_value: {n_needles: 4, new_tokens: 32}}}' \
      --set 'perplexity={windows: 0}' --set 'qa=null' "$@" ;;
  qwen_snapkv_1_16)  # issue 12: Qwen2.5's multi-value needles and QA at 32K, 1/16, for SnapKV and SnapKV 1/4 + Quest
    run qwen2.5 --out "$R" --set 'lengths=[32768]' --set 'budgets=["1/16"]' \
      --set "policies=[{name: dense}, $SK, $SQ]" \
      --set 'decisive={policies: [dense, snapkv, snapkv1/4+quest], budgets: ["1/16"]}' \
      --set "$MV32" \
      --set 'perplexity={windows: 0}' \
      --set "$QA32" "$@" ;;
  qwen_grid)  # issue 12: Qwen2.5's eight policies: 1/16 first, then 1/8 and 1/32 (resumes)
    run qwen2.5 --out "$R" --set "policies=[{name: dense}, $O, $QU, $TT, $BT, $SW, $SK, $SQ]" \
      --set 'decisive={policies: [dense, oracle, quest, token_topk, block_topk, sink_window, snapkv, snapkv1/4+quest], budgets: ["1/16"]}' \
      "$@" ;;
  gemma_grid)  # issue 12: Gemma-3's eight policies and quant4 (issue 13's quality winner): 1/16 first, then 1/8 and 1/32
    run gemma3 --out "$R" --set "policies=[{name: dense}, $O, $QU, $Q4, $TT, $BT, $SW, $SK, $SQ]" \
      --set 'decisive={policies: [dense, oracle, quest, quant4, token_topk, block_topk, sink_window, snapkv, snapkv1/4+quest], budgets: ["1/16"]}' \
      "$@" ;;
  grid_one_pass_smollm2|grid_one_pass_gemma3|grid_one_pass_qwen2.5)  # issue 12: the model's whole grid (its config's
    # lengths, needles, QA) for issue 12's eight policies at 1/8, 1/16, 1/32 in one pass, captured steps kept across batches
    run "${PART#grid_one_pass_}" --out "$R" --set "policies=[{name: dense}, $O, $QU, $TT, $BT, $SW, $SK, $SQ]" \
      --set one_pass=true --set static=true --set reuse_graphs=true --set perplexity.compressed=simulate "$@" ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
