# Sourced by the check scripts whose steps write into a scratch folder, with
# the pack's file name: `source "$HERE/scratch_pack.sh" NAME.tgz`. The
# caller's OUT (default ./out) becomes FINAL; OUT points at a new scratch
# folder, and PACK at $FINAL/NAME.tgz, where bench/h200/run.sh packs
# everything under OUT after each step (the device tool returns only a few
# files a call).
FINAL=${OUT:-$PWD/out}
mkdir -p "$FINAL"
OUT=$(mktemp -d)
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
export PACK="$FINAL/$1"
