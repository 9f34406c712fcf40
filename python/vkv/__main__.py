"""``python -m vkv``: the version, the backends this build has (or why not), torch, CUDA
and the GPUs found, and what ``device="auto"`` picks. Paste it into bug reports."""

from ._environment import report


def main() -> None:
    lines = report()
    width = max(len(label) for label in lines)
    for label, value in lines.items():
        print(f"{label + ':':<{width + 1}} {value}")


if __name__ == "__main__":
    main()
