# Sourced by tsan.sh and asan.sh. `sanitizer_reports DIR TOOL` makes DIR/TOOL-logs/ afresh
# for the reports every process writes (as $logs, the sanitizers' log_path prefix is
# $logs/report) and shows them however the run ends (halt_on_error stops a test at its first
# report): any report fails the run. `show_reports` checks once more at the end.
sanitizer_reports() {
  logs=$PWD/$1/$2-logs
  sanitizer_tool=$2
  rm -rf "$logs" && mkdir -p "$logs"
  trap 'show_reports || exit 1' EXIT
}
show_reports() {
  if compgen -G "$logs/report*" >/dev/null; then
    cat "$logs"/report*
    echo "$sanitizer_tool: the reports above (from the tests or a kvmemd they started)"
    return 1
  fi
}
