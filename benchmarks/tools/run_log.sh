# Sourced by the benchmark drivers. `json_lines` passes a run's whole output (stdout and stderr) to
# /tmp/jt/runs.log, so a run that fails leaves its error there, and prints only its JSON result lines; a line
# that follows a cleared progress bar (tqdm ends with "\r") is read from after its last "\r".
mkdir -p /tmp/jt
export PYTHONFAULTHANDLER=1  # a crash in native code leaves the Python stack in runs.log
json_lines() { tee -a /tmp/jt/runs.log | sed -u 's/.*\r//' | grep --line-buffered '^{"'; }
