"""transformers.Trainer with DeepSpeed ZeRO (stage from argv) and SonarAdamW, one rank of a torchrun launch
(tests/test_deepspeed.py): prints the refusal it gets, and whether any parameter changed."""

import os
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from trainer_data_parallel import Tokens, tiny_olmoe

import sonar_kernels
from sonar_kernels.integrations import transformers as sonar_transformers


def main(stage: int) -> None:
    sonar_transformers.register()
    config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage}, "gradient_clipping": "auto",
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        training = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2, report_to=[],
            save_strategy="no", logging_strategy="no", use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0, seed=0, deepspeed=config,
        )  # fmt: skip
        model = tiny_olmoe()
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        trainer = transformers.Trainer(
            model=model, args=training, train_dataset=Tokens(),
            optimizer_cls_and_kwargs=(sonar_kernels.SonarAdamW, {"lr": 1e-2}),
        )  # fmt: skip
        try:
            trainer.train()
            print("refusal: none")
        except (RuntimeError, ValueError) as error:
            print(f"refusal: {type(error).__name__}: {error}")
        changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
        print(f"changed: {changed}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(int(sys.argv[1]))
