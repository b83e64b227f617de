# Sourced by the bench scripts: start/stop one OpenAI-compatible server on $PORT and wait until /health
# answers. `stop_server` runs on exit.
server_pid=
stop_server() { [ -z "$server_pid" ] || { kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; server_pid=; }; }
trap stop_server EXIT
wait_ready() { # log file named in errors
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0
    kill -0 "$server_pid" 2>/dev/null || { echo "the server exited; see $1" >&2; exit 1; }
    sleep 0.5
  done
  echo "the server did not become ready; see $1" >&2; exit 1
}
