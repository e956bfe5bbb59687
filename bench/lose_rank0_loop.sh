#!/bin/bash
# N runs (default 20) of the lose@rank=0 spare scenario (resume_main.py, 2 training ranks + 1 spare), counting how each carried on.
cd "$(dirname "$0")/.."
N=${1:-20}; live=0; ckpt=0; other=0
for i in $(seq 1 $N); do
  out=${OUT:-/tmp/lose_rank0_runs}/run$i; rm -rf $out; mkdir -p $out/ignite-1/ckpt
  PYTHONPATH=$PWD:$PWD/tests PG_TIMEOUT_SEC=20 EPOCHS=1 EVERY=10 INPLACE=2 SPARES=1 FTH_INJECT="lose@rank=0,iteration=37" \
    timeout -k 5 150 ${PYTHON:-.venv/bin/python} -m torch.distributed.run --standalone --nproc-per-node 3 --max-restarts 0 \
    --monitor-interval 0.5 tests/resume_main.py ignite $out/ignite-1 > $out/log 2>&1
  rc=$?
  # kill what is left of the run, by pid
  for f in $out/ignite-1/process_launched*.json; do pg=$(${PYTHON:-.venv/bin/python} -c "import json,sys;print(json.load(open('$f'))['pgid'])" 2>/dev/null); [ -n "$pg" ] && kill -9 -- -$pg 2>/dev/null; done
  # both training ranks say what they carried on from (the lines of recover/ and data/live.py)
  if [ "$(grep -c "carries on from live state, iteration" $out/log)" = 2 ]; then live=$((live+1)); r=live
  elif grep -q "live state could not serve" $out/log; then ckpt=$((ckpt+1)); r=checkpoint
  else other=$((other+1)); r=other; fi
  echo "run $i: rc=$rc $r"
done
echo "runs $N: live $live, checkpoint $ckpt, other $other"
