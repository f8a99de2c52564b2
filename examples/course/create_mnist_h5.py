"""Write MNIST (or the scikit-learn digits fallback) as one chunked HDF5 file for step 8's streaming loader.

    python create_mnist_h5.py --out data/mnist.h5
    python create_mnist_h5.py --data-dir ~/data/mnist --out data/mnist.h5 --chunk-size 512

Layout: groups /train and /test, each with `images` (N, 28, 28) uint8 and `labels` (N,) uint8, stored
in chunks of --chunk-size samples. HDF5 reads and decompresses whole chunks, so a loader that reads
one chunk at a time touches each byte on disk once per epoch and holds one chunk in memory.
"""

import argparse
from pathlib import Path

import h5py
from course_common import load_mnist_raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="folder with the MNIST IDX files")
    parser.add_argument("--out", type=Path, default=Path("data/mnist.h5"))
    parser.add_argument("--chunk-size", type=int, default=256, help="samples per HDF5 chunk")
    parser.add_argument("--compression", choices=["none", "gzip", "lzf"], default="lzf")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    compression = None if args.compression == "none" else args.compression
    with h5py.File(args.out, "w") as f:
        for split in ("train", "test"):
            images, labels, source = load_mnist_raw(args.data_dir, split)
            chunk = min(args.chunk_size, len(labels))
            group = f.create_group(split)
            group.create_dataset("images", data=images.numpy(), chunks=(chunk, 28, 28), compression=compression)
            group.create_dataset("labels", data=labels.numpy(), chunks=(chunk,), compression=compression)
            group.attrs["source"] = source
            print(f"{split}: {len(labels)} images from {source}, {-(-len(labels) // chunk)} chunks of {chunk}",
                  flush=True)
        f.attrs["chunk_size"] = args.chunk_size
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
