"""Below models/ and codecs/ (both import it; it imports neither, nor anything of omnivox): the on-disk cache that
everything built is kept in, with its one locked, atomic build (cache.py), and building native code, the C kernels,
for the CPU it runs on (kernel_build.py)."""
