# Debian packages for the CI scripts (sourced, not run): apt and dpkg one at a
# time, as .ci/run runs steps side by side and a second apt-get or dpkg fails on
# the lock the first holds.  As root, or through sudo.
#
#   . "$(dirname "${BASH_SOURCE[0]}")/apt.sh"
#   ci_apt_install PKG...          apt-get update, then install, quietly
#   ci_apt ARGS...                 any apt-get command under the lock
#   ci_locked CMD ARGS...          any command (dpkg, ...) under the lock, as root
ci_locked() {
    local sudo=""
    [[ "$(id -u)" == 0 ]] || sudo="sudo"
    (
        flock 9
        $sudo env DEBIAN_FRONTEND=noninteractive "$@"
    ) 9>"${TMPDIR:-/tmp}/sdpa-ci-apt.lock"
}

ci_apt() { ci_locked apt-get "$@"; }

ci_apt_install() {
    ci_apt update -qq
    ci_apt install -y -qq "$@" >/dev/null
}
