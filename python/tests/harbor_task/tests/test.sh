#!/bin/bash
# Reward 1 when /app/out.txt is right and the service still holds, in memory, what it was told.
set -u
sleep 1.5   # long enough for a host-side fault to land mid-action
reward=0
expected=$(printf 'ALPHA\nBETA\nGAMMA\nDELTA\nEPSILON\n')
got=$(python3 - <<'PY'
import os, socket
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ.get("TALLY_SOCKET", "/run/tally.sock"))
s.sendall(b"get")
print(s.recv(64).decode())
PY
)
echo "out.txt: $(tr '\n' ' ' < /app/out.txt); tally: $got; built: $(cat /app/built.txt)"
if [ "$(cat /app/out.txt)" = "$expected" ] && [ "$got" = "5" ] && [ "$(cat /app/built.txt)" = hello ]; then
  reward=1
fi
echo "$reward" > /logs/verifier/reward.txt
