"""Train a small GPT with each precision strategy side by side (fp32 master weights, plain
bf16, collage-light, collage-plus): same data, seed and batches; a table, a PNG and a JSON.

    python examples/train_gpt.py [--steps 200] [--lr 1e-4] [--data FILE] [--device cuda]

The implementation is ``collage_compile/demo.py`` (also ``python -m collage_compile.demo``
and the ``collage-demo`` command); ``--help`` lists every option.
"""

from collage_compile.demo import main

if __name__ == "__main__":
    main()
