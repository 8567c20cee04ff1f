#!/usr/bin/env bash
# Install (or with --remove, uninstall) KVScope's desktop entry, icons and trace file type for the current user,
# pointing at this checkout's launcher. Prints every file it writes or removes.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
sizes="16 24 32 48 64 128 256 512"
files=("$data/applications/kvscope.desktop" "$data/mime/packages/kvscope.xml" "$data/icons/hicolor/scalable/apps/kvscope.svg")
for size in $sizes; do files+=("$data/icons/hicolor/${size}x${size}/apps/kvscope.png"); done

refresh() {
  command -v update-desktop-database >/dev/null && update-desktop-database "$data/applications" || true
  command -v update-mime-database >/dev/null && update-mime-database "$data/mime" >/dev/null || true
}

if [[ "${1:-}" == "--remove" ]]; then
  for f in "${files[@]}"; do [[ -e "$f" ]] && rm -f "$f" && echo "removed $f"; done
  refresh
  exit 0
fi

launcher="${1:-$root/.venv/bin/kvscope}"
mkdir -p "$data/applications" "$data/mime/packages" "$data/icons/hicolor/scalable/apps"
for size in $sizes; do
  mkdir -p "$data/icons/hicolor/${size}x${size}/apps"
  cp "$root/resources/icons/kvscope-$size.png" "$data/icons/hicolor/${size}x${size}/apps/kvscope.png"
done
cp "$root/resources/icons/kvscope.svg" "$data/icons/hicolor/scalable/apps/kvscope.svg"
cp "$root/packaging/kvscope-mime.xml" "$data/mime/packages/kvscope.xml"
sed "s|^Exec=kvscope|Exec=$launcher|" "$root/packaging/kvscope.desktop" > "$data/applications/kvscope.desktop"
refresh
printf 'installed %s\n' "${files[@]}"
echo "the entry starts $launcher; *.kvscope.jsonl traces open in KVScope"
echo "to remove all of it: make uninstall-desktop"
