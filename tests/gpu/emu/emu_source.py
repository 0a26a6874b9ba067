#!/usr/bin/env python3
"""emu_source.py IN OUT - a kernel source of kernels/cuda made compilable as
C++ for the CPU emulation (emu_cuda.h): every launch
    kernel<<<grid, block, smem, stream>>>(args);
becomes
    emu_launch(kernel, grid, block, smem, stream, args);
Nothing else changes; a line directive keeps errors pointing at IN."""
import re
import sys

LAUNCH = re.compile(r'(\w+(?:<[^>;()]*>)?)<<<(.*?)>>>\((.*?)\);', re.S)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    out, n = LAUNCH.subn(r'emu_launch(\1, \2, \3);', text)
    if '<<<' in out:
        sys.exit('emu_source.py: %s: a launch this script cannot rewrite' % src)
    with open(dst, 'w') as f:
        f.write('#line 1 "%s"\n' % src)
        f.write(out)


if __name__ == '__main__':
    main()
