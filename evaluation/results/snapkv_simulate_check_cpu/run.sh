set -u
POL='policies=[{name: dense}, {name: snapkv, sink: 4, window: 32, observe: 32}, {name: snapkv, label: snapkv1/4+quest, budget: "1/4", sink: 4, window: 32, observe: 32, then: {name: quest, sink: 4, window: 32}}]'
for way in decode simulate; do
  rm -rf /tmp/sim/$way
  /usr/bin/time -f "$way %e s" .venv/bin/hf-sparse-kv suite smollm2 --out /tmp/sim/$way --set 'lengths=[4096]' --set 'budgets=["1/16"]' --set "$POL" \
    --set 'decisive={policies: [dense], budgets: ["1/16"]}' --set perplexity.windows=2 --set 'needle={trials: 0}' --set one_pass=true \
    --set perplexity.compressed=$way > /tmp/sim/$way.log 2>&1
done
