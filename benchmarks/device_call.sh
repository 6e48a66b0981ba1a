#!/usr/bin/env bash
# One device call's wrapper: benchmarks/device_varlen.sh STEP... under a time limit
# (DEVICE_LIMIT seconds, default 560: the call's 600 less the transfers), its logs kept
# in /tmp/fj_out and packed into $OUT/logs.tgz at the end, even when the limit cut the
# steps (the device returns at most 8 files from $OUT; the steps write dozens).
# Usage (the `run` tool's command): benchmarks/device_call.sh build tests dense
#   then here: tar -xzf /work/.device/N/logs.tgz -C /tmp/logsN
set -u
RESULT=${OUT:-/tmp/out}
mkdir -p "$RESULT" /tmp/fj_out
OUT=/tmp/fj_out timeout -k 10 "${DEVICE_LIMIT:-560}" "$(dirname "$0")/device_varlen.sh" "$@"
rc=$?
[ $rc = 124 ] || [ $rc = 137 ] && echo "device_call: cut at ${DEVICE_LIMIT:-560} s (rc $rc)"
# (a second run in the same command writes logs2.tgz, and so on)
logs=logs.tgz n=1
while [ -e "$RESULT/$logs" ]; do n=$((n + 1)); logs=logs$n.tgz; done
tar -czf "$RESULT/$logs" -C /tmp/fj_out . && echo "device_call: logs in $logs ($(du -h "$RESULT/$logs" | cut -f1))"
exit $rc
