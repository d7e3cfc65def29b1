#!/bin/bash
# The GPU kit (../shared/gpu/build-kit.sh -> .gpukit/part1..3) in pieces small enough to travel beside
# the committed reference LM: a device call carries 64 MiB in all, working tree (~45 MB) included.
#   here:   bash tools/kit_pieces.sh split          -> .gpukit/c01 .. c11, one <= 16 MiB piece each
#   device: carry [".gpukit/bin", ".gpukit/cNN"], command `bash tools/kit_pieces.sh gather`, NN = 01, 02, ...
#           back to back; a part is rebuilt and unpacked once its last (short) piece has come.
set -e
KIT="$(cd "$(dirname "$0")/.." && pwd)/.gpukit"
PIECE=$((16 * 1024 * 1024))
case "$1" in
split)
  rm -rf "$KIT"/c[0-9]* && tmp=$(mktemp -d) && i=0
  for p in part1 part2 part3; do
    tar -C "$KIT" -cf - $p | split -b $PIECE -d - "$tmp/$p.tar.piece."
    # A part of an exact multiple of the piece size gets an empty last piece, which marks its end.
    [ $(($(stat -c %s "$(ls "$tmp"/$p.tar.piece.* | tail -1)") % PIECE)) -ne 0 ] || : >"$tmp/$p.tar.piece.99"
    for f in "$tmp"/$p.tar.piece.*; do i=$((i + 1)); mkdir -p "$(printf "%s/c%02d" "$KIT" $i)"; mv "$f" "$_"; done
  done
  for d in "$KIT"/c[0-9]*; do echo "$(basename "$d"): $(ls "$d")"; done ;;
gather)
  mkdir -p /tmp/kitpieces /tmp/site
  for d in "$KIT"/c[0-9]*; do [ -d "$d" ] && cp "$d"/* /tmp/kitpieces/; done
  for p in part1 part2 part3; do
    pieces=$(ls /tmp/kitpieces/$p.tar.piece.* 2>/dev/null | sort) || continue
    [ -n "$pieces" ] && [ "$(stat -c %s "$(echo "$pieces" | tail -1)")" -lt $PIECE ] || continue
    cat $pieces | tar -C "$KIT" -xf - && rm -f $pieces && echo "rebuilt $p"
  done
  bash "$KIT/bin/unpack.sh" ;;
*) echo "usage: $0 split|gather" >&2; exit 2 ;;
esac
