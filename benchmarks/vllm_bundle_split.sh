#!/usr/bin/env bash
# Re-cuts the vLLM bundle's .tar.xz stream (prepare.sh writes it as .vp1/chunk_aa + .vp2/chunk_ab)
# so that each device call stays under the 64 MiB it may carry with this repository's tree:
# .vp1 and .vp2 take as much as fits beside the tree (less MARGIN), .vp2b the rest, which travels
# with the wheels (.vp3) and the model directory in vllm_compare.sh's stage 3 (or alone, in a call
# of its own, when the tree has grown so far that the three no longer fit one). Where the wheels
# alone no longer fit a call beside the tree, the largest move to .vp4 until they do: carry .vp4
# with .vp2b (and install it as .vp3's wheels are installed).
# Usage (repo root, after prepare.sh): bash benchmarks/vllm_bundle_split.sh [MARGIN_BYTES]
set -eu
margin=${1:-1500000}
limit=$((64 * 1024 * 1024))
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
part=$((limit - tree - margin))
tmp=$(mktemp -d)
find .vp1 .vp2 $(ls -d .vp2b 2>/dev/null) -type f | sort | xargs cat > "$tmp/stream"   # a re-cut: .vp2b too
size=$(stat -c %s "$tmp/stream")
rm -rf .vp1 .vp2 .vp2b .vp1b && mkdir -p .vp1 .vp2 .vp2b
head -c "$part" "$tmp/stream" > .vp1/part1
tail -c +$((part + 1)) "$tmp/stream" | head -c "$part" > .vp2/part2
tail -c +$((2 * part + 1)) "$tmp/stream" > .vp2b/part3
rm -rf "$tmp"
mkdir -p .vp4 && mv .vp4/*.whl .vp3/ 2>/dev/null || true   # a re-cut starts from all the wheels
while [ $((tree + $(du -sb .vp3 | cut -f1) + margin)) -gt $limit ]; do
  mv "$(ls -S .vp3/*.whl | head -1)" .vp4/
done
rest=$(stat -c %s .vp2b/part3); wheels=$(du -sb .vp3 | cut -f1)
echo "stream $size bytes; tree $tree; .vp1 and .vp2 $part each; .vp2b $rest (+ .vp3 $wheels in stage 3)"
[ -n "$(ls .vp4)" ] && echo "moved to .vp4 (carry it with .vp2b): $(ls .vp4 | tr '\n' ' ')"
[ $((tree + rest + wheels + 4000000)) -le $limit ] || echo "warning: stage 3's carry may pass 64 MiB"
