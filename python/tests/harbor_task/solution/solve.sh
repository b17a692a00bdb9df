#!/bin/bash
# Three steps: the file, the service, then telling the service its state.
set -euo pipefail
cd /app
tr ' ' '\n' < seed.txt | tr '[:lower:]' '[:upper:]' > out.txt
setsid python3 /opt/tally/tally.py </dev/null >/dev/null 2>&1 &
for _ in $(seq 50); do [ -S "$TALLY_SOCKET" ] && break; sleep 0.1; done
sleep 1.5   # long enough for a host-side fault to land mid-action
words=$(wc -l < out.txt)
python3 - "$words" <<'PY'
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["TALLY_SOCKET"])
s.sendall(b"set " + sys.argv[1].encode())
assert s.recv(8) == b"ok"
PY
echo "solved: $words words"
