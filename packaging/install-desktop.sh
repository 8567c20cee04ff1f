#!/usr/bin/env bash
# Install the desktop entry and icons for the current user, pointing at this checkout's launcher.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
launcher="${1:-$root/.venv/bin/kvscope}"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
mkdir -p "$data/applications"
for size in 16 24 32 48 64 128 256 512; do
  mkdir -p "$data/icons/hicolor/${size}x${size}/apps"
  cp "$root/resources/icons/kvscope-$size.png" "$data/icons/hicolor/${size}x${size}/apps/kvscope.png"
done
mkdir -p "$data/icons/hicolor/scalable/apps"
cp "$root/resources/icons/kvscope.svg" "$data/icons/hicolor/scalable/apps/kvscope.svg"
sed "s|^Exec=kvscope|Exec=$launcher|" "$root/packaging/kvscope.desktop" > "$data/applications/kvscope.desktop"
command -v update-desktop-database >/dev/null && update-desktop-database "$data/applications" || true
echo "installed $data/applications/kvscope.desktop (Exec=$launcher)"
