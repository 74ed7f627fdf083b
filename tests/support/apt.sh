# Sourced by the setup scripts: `apt_install PKG...` installs Debian packages (as root, or
# through sudo); nothing when given none.
apt_install() {
  [ $# -gt 0 ] || return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "$(basename "$0" .sh): installing $*" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
