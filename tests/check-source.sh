#!/bin/sh
# tests/check-source.sh - checks of the source's shape that a reader relies on: kvr.c's table of
# contents names its numbered section banners in order, kvr.c includes kvr.h once and carries no
# pasted-file guards, and no model builder is declared ahead of its definition. Prints one
# "N passed, M failed" line like every test program.
pass=0
fail=0
check() { # description, then a command that succeeds when the check holds
    d=$1; shift
    if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $d"; fi
}

# the table of contents: "//   N. name   what" lines at the top; the banners: "// N. name..."
# right after a line holding only "//"
toc=$(sed -n '1,/^#define/p' kvr.c | sed -n 's|^// *\([0-9][0-9]*\)\. \([a-zA-Z:]*\).*|\1 \2|p')
banners=$(awk 'prev == "//" && /^\/\/ [0-9]+\. / { sub(/^\/\/ /, ""); split($0, w, " "); sub(/[.:]$/, "", w[2]); print w[1] " " w[2] } { prev = $0 }' kvr.c | sed 's/^\([0-9]*\)\. /\1 /')
toc_clean=$(printf '%s\n' "$toc" | sed 's/:$//')
check "kvr.c has a table of contents" [ -n "$toc" ]
check "kvr.c's table of contents matches its section banners (number and first word, in order)" \
    [ "$toc_clean" = "$banners" ]
[ "$toc_clean" = "$banners" ] || { echo "contents:"; printf '%s\n' "$toc_clean"; echo "banners:"; printf '%s\n' "$banners"; }
check "kvr.c includes kvr.h exactly once" [ "$(grep -c '^#include "kvr.h"' kvr.c)" -eq 1 ]
check "no KVR_AMALGAMATED guards are left" [ "$(grep -c 'KVR_AMALGAMATED' kvr.c kvr.h kvr-comm.c kvr-tune.c | awk -F: '{ n += $2 } END { print n }')" -eq 0 ]
check "no model builder is declared before its definition" \
    [ "$(grep -cE '^static [a-z_ *]*(_load|_build)\(.*\);$' kvr.c)" -eq 0 ]

echo "check-source: $pass passed, $fail failed"
[ $fail -eq 0 ]
