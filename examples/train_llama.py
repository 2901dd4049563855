"""Train a Hugging Face Llama with each precision strategy side by side (the GPU main job):
fp32 weights with bf16 autocast and fused AdamW, plain bf16 with fused AdamW, collage light
and plus; validation loss and its gap to fp32, tokens/s, step and optimizer times, peak memory.

    python examples/train_llama.py --device cuda [--cudagraphs] [--steps 300]

The implementation is ``collage_compile/demo_llama.py``; ``--help`` lists every option.
"""

from collage_compile.demo_llama import main

if __name__ == "__main__":
    main()
