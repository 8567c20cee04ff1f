#!/usr/bin/env bash
# Install (or with --remove, uninstall) KVScope's desktop entry, icons and trace file type for the current user,
# pointing at the launcher given (default: this checkout's .venv/bin/kvscope). Prints every file and folder it
# writes or removes. What it created (folders that did not exist, a user MIME database that did not exist) is
# noted in a manifest, so --remove takes away exactly that and leaves what was there before.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
manifest="$data/kvscope/desktop-install.txt"
sizes="16 24 32 48 64 128 256 512"
files=("$data/applications/kvscope.desktop" "$data/mime/packages/kvscope.xml" "$data/icons/hicolor/scalable/apps/kvscope.svg")
dirs=("$data/applications" "$data/mime" "$data/mime/packages" "$data/icons" "$data/icons/hicolor"
      "$data/icons/hicolor/scalable" "$data/icons/hicolor/scalable/apps")
for size in $sizes; do
  files+=("$data/icons/hicolor/${size}x${size}/apps/kvscope.png")
  dirs+=("$data/icons/hicolor/${size}x${size}" "$data/icons/hicolor/${size}x${size}/apps")
done

refresh() {
  command -v update-desktop-database >/dev/null && update-desktop-database "$data/applications" 2>/dev/null || true
  command -v update-mime-database >/dev/null && [[ -d "$data/mime" ]] && update-mime-database "$data/mime" >/dev/null || true
}

if [[ "${1:-}" == "--remove" ]]; then
  for f in "${files[@]}"; do [[ -e "$f" ]] && rm -f "$f" && echo "removed $f"; done
  created_db=no
  [[ -f "$manifest" ]] && grep -qx "mime-database" "$manifest" && created_db=yes
  if [[ "$created_db" == yes && -d "$data/mime" ]] && [[ -z "$(ls -A "$data/mime/packages" 2>/dev/null)" ]]; then
    # The user MIME database was generated for KVScope alone: its generated files go with it.
    find "$data/mime" -mindepth 1 -maxdepth 1 ! -name packages -exec rm -rf {} + && echo "removed $data/mime (generated database)"
  else
    refresh
  fi
  if [[ -f "$manifest" ]]; then
    # Folders KVScope created, deepest first, each only if nothing else is in it now.
    grep '^dir ' "$manifest" | cut -d' ' -f2- | awk '{ print length, $0 }' | sort -rn | cut -d' ' -f2- |
      while read -r dir; do rmdir "$dir" 2>/dev/null && echo "removed $dir/"; done
    rm -f "$manifest" && rmdir "$data/kvscope" 2>/dev/null || true
  fi
  exit 0
fi

launcher="${1:-$root/.venv/bin/kvscope}"
mkdir -p "$data/kvscope"
: > "$manifest"
[[ -e "$data/mime/mime.cache" ]] || echo "mime-database" >> "$manifest"
for dir in "${dirs[@]}"; do
  if [[ ! -d "$dir" ]]; then
    mkdir -p "$dir"
    echo "dir $dir" >> "$manifest"
  fi
done
for size in $sizes; do
  cp "$root/resources/icons/kvscope-$size.png" "$data/icons/hicolor/${size}x${size}/apps/kvscope.png"
done
cp "$root/resources/icons/kvscope.svg" "$data/icons/hicolor/scalable/apps/kvscope.svg"
cp "$root/packaging/kvscope-mime.xml" "$data/mime/packages/kvscope.xml"
sed "s|^Exec=kvscope|Exec=$launcher|" "$root/packaging/kvscope.desktop" > "$data/applications/kvscope.desktop"
refresh
printf 'installed %s\n' "${files[@]}"
echo "the entry starts $launcher; *.kvscope.jsonl traces open in KVScope"
echo "to remove all of it: make uninstall-desktop"
