"""A service that keeps one number in memory: `set N` stores it, `get` returns it."""
import os
import socket

path = os.environ.get("TALLY_SOCKET", "/run/tally.sock")
try:
    os.unlink(path)
except FileNotFoundError:
    pass
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen()
value = b"unset"
while True:
    conn, _ = server.accept()
    with conn:
        request = conn.recv(64)
        if request.startswith(b"set "):
            value = request[4:].strip()
            conn.sendall(b"ok")
        else:
            conn.sendall(value)
