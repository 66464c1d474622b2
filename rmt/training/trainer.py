"""The training loop on megatron-core: DDP-wrapped model chunks (:mod:`rmt.training.ddp`), the
forward-backward schedule (microbatches, gradient accumulation, 1F1B or interleaved pipelining),
megatron's optimizer for the dense parameters beside the memory tables' own
(:mod:`rmt.training.optimizer`), the LR schedule, gradient clipping by the global norm, a moving
average of the weights (``train.ema_decay``), validation, checkpoints (resumed by default, saved
on preemption signals and Ctrl-C), TensorBoard scalars and a progress bar."""

from __future__ import annotations

import json
import math
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from rmt import config as rmt_config
from rmt.config import RMTConfig
from rmt.data.training_data import TrainingData
from rmt.memory.hooks import MemoryHooks
from rmt.models.build import build
from rmt.models.documents import causal_mask
from rmt.parallel import compat
from rmt.training import checkpoint, preemption
from rmt.training.ddp import wrap_chunks
from rmt.training.fit import step_prediction
from rmt.training.host_heap import retain_freed_memory
from rmt.training.loss import lm_loss
from rmt.training.lr_control import ValidationLR
from rmt.training.optimizer import build_optimizer, build_scheduler, warmup_steps
from rmt.training.same_model import model_difference
from rmt.training.step_log import new_run_name, open_jsonl, open_tensorboard, run_log_dir
from rmt.training.weight_average import WeightAverage

#: The losses a step reports, in the order of :meth:`Trainer._reduce_losses`' tensor.
LOSSES = ("lm loss", "loss")


class Trainer:
    """Build everything for ``config`` in the current process group and train.

    ``initialize`` (process groups) must have run. Data problems raise ``UserError`` before any
    step runs. The run continues from the newest complete checkpoint under ``train.save``, else
    from ``train.load``, else from step 0 (``checkpoint.resume``).
    """

    def __init__(self, config: RMTConfig):
        self.config = config
        t = config.train
        if t.threads:
            torch.set_num_threads(t.threads)
        retain_freed_memory(t.host_heap_retain_mib)
        torch.set_flush_denormal(t.flush_denormal)
        self.device = compat.device()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.global_batch = t.global_batch_size or t.micro_batch_size * self.dp_size
        self.num_microbatches = self.global_batch // (t.micro_batch_size * self.dp_size)
        evals = (t.steps // t.eval_interval + 2) if t.eval_iters else 0
        # Synthetic tasks (rmt.data.tasks) replace the corpus: their validation set is fixed.
        valid_samples = (1 if config.data.task != "none" else evals) * t.eval_iters * self.global_batch
        self.data = TrainingData(
            config, t.steps * self.global_batch, valid_samples, self.global_batch, self.dp_rank, self.dp_size
        )
        self.memory = MemoryHooks(config)
        with self.memory.building(checkpoint.will_resume(t.save, t.load)):
            self.chunks = wrap_chunks(build(config), config, self.memory)
        self.params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.chunks, config)
        self.memory.bind(self.chunks, self.num_microbatches)
        self.scheduler = build_scheduler(self.optimizer, config)
        self.lr_control = ValidationLR(config)
        self.average = WeightAverage(self.chunks, t.ema_decay) if t.ema_decay is not None else None
        averages = self.average.by_param() if self.average is not None else None
        self.mask = causal_mask(config.model.seq_length, self.device)
        self.iteration = 0
        self.consumed_samples = 0
        self.history: List[Dict] = []
        self.tokens_this_run = 0  # tokens trained on since this process started
        self.is_logger = (dist.get_rank() if dist.is_initialized() else 0) == 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # the model FLOPs of a step and the step-time model's prediction (rmt-plan time), for the log
        self.prediction = step_prediction(config, self.world_size, "cpu" if self.device.type == "cpu" else "gpu")
        self._bar = None
        self.stopped_by: Optional[str] = None  # the signal that ended the run early
        self.last_save: Optional[str] = None
        if t.save:
            checkpoint.check_space(t.save, self.chunks, self.optimizer, averages)
        resumed = checkpoint.resume(
            t.save, t.load, self.chunks, self.optimizer, self.say, partial(model_difference, config), averages
        )
        self.run_name = new_run_name()
        if resumed is not None:
            self.last_save, common = resumed
            self._restore(common)
            self.run_name = common.get("run_name", self.run_name)
            self.say(f"resumed from iteration {self.iteration} of {t.steps}: '{self.last_save}'")
            if self.average is not None and not common.get("ema"):
                self.average.restart()
                self.say("the checkpoint has no weight average (train.ema_decay): it starts at the loaded weights")
        else:
            self.say(
                "starting from step 0"
                + (
                    f": no checkpoint in '{t.save}' yet"
                    if t.save
                    else " (train.save is not set: no checkpoints are kept)"
                )
            )
        if warmup_steps(config) < t.warmup_steps:
            self.say(
                f"train.warmup_steps {t.warmup_steps} is not below train.steps {t.steps}: "
                f"warming up over {warmup_steps(config)} steps instead"
            )

    # -- setup ---------------------------------------------------------------------------
    def say(self, message: str) -> None:
        """Tell the user what happened (global rank 0; above the progress bar when there is one)."""
        if not self.is_logger:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    @property
    def train_ds(self):
        return self.data.train_ds

    @property
    def valid_ds(self):
        return self.data.valid_ds

    def _restore(self, common: dict) -> None:
        self.iteration = int(common["iteration"])
        self.consumed_samples = int(common["consumed_samples"])
        checkpoint.set_optimizer_step(self.optimizer, self.iteration)
        if "data_state" in common:
            self.data.load_state_dict(common["data_state"])
        if "lr_control" in common:
            self.lr_control.load_state_dict(common["lr_control"])
            self.scheduler.scale = self.lr_control.scale
        if self.iteration:
            self.scheduler.step(self.iteration)

    # -- one step ------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        self.memory.before_forward(next(i for i, c in enumerate(self.chunks) if c is model))
        batch = next(data_iterator)
        tokens = batch["tokens"].to(self.device)
        positions = batch["position_ids"].to(self.device)
        labels = batch["labels"].to(self.device)
        loss_mask = batch["loss_mask"].to(self.device)
        mask = batch.get("attention_mask")  # per-sample document masks (data.reset_attention_mask)
        if mask is not None:
            mask = mask.to(self.device)
        elif tokens.shape[1] == self.mask.shape[-1]:
            mask = self.mask
        else:
            mask = causal_mask(tokens.shape[1], self.device)
        output = model(tokens, positions, mask)
        return output, partial(self._loss, labels, loss_mask, self.memory.pop_aux_loss(model))

    def _loss(self, labels, loss_mask, aux_loss, output):
        loss, ce = lm_loss(output, labels, loss_mask, self.config.train.z_loss)
        if aux_loss is not None:
            loss = loss + aux_loss
        return loss, {"lm loss": ce.clone(), "loss": loss.detach().clone()}

    def _run_schedule(self, split: str, first_sample: int, forward_only: bool) -> torch.Tensor:
        """The schedule over one global batch of ``split`` (``train``, ``valid``); its losses
        (:meth:`_reduce_losses`)."""
        t = self.config.train
        batches = self.data.batches(split, first_sample, t.micro_batch_size, self.num_microbatches)
        # task curricula grow the samples, so count the tokens of the batch actually run
        self.batch_tokens = sum(b["tokens"].numel() for b in batches) * self.dp_size
        iters = [iter(batches) for _ in self.chunks]
        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.chunks,
            num_microbatches=self.num_microbatches,
            seq_length=self.config.model.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=forward_only,
        )
        return self._reduce_losses(losses)

    def _reduce_losses(self, losses) -> torch.Tensor:
        """Mean over microbatches and data-parallel ranks of each of :data:`LOSSES`, made known to
        every rank: an fp64 tensor on the compute device, read by the caller (a wait for the
        device, which the training step shares with the gradient norm's)."""
        # on the compute device: an NCCL process group takes no CPU tensors
        vals = torch.zeros(len(LOSSES), dtype=torch.float64, device=compat.device())
        owner = (
            parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
        )
        if owner and losses:
            # summed on the device: reading each micro-batch's loss would wait for the device each time
            vals.copy_(
                torch.stack([torch.stack([d[n].reshape(()).double() for n in LOSSES]) for d in losses]).sum(0)
                / len(losses)
                / self.dp_size
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vals)
        return vals

    def train_step(self) -> Dict[str, float]:
        start = time.perf_counter()
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)
        self.memory.start_step()
        losses = self._run_schedule("train", self.consumed_samples, forward_only=False)
        self.memory.after_backward()
        self.optimizer.prepare_grads()
        # the step's one wait for the device: its losses and gradient norm, read together
        *values, norm_sq = torch.cat([losses, self.optimizer.grad_sq_norm().reshape(1)]).tolist()
        metrics = dict(zip(LOSSES, values))
        metrics["grad_norm"] = norm_sq**0.5
        self.optimizer.clip(self.config.train.clip_grad, metrics["grad_norm"])
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.average is not None:
            self.average.update()
        self.scheduler.step(1)
        self.iteration += 1
        self.consumed_samples += self.global_batch
        self.tokens_this_run += self.batch_tokens
        elapsed = time.perf_counter() - start
        metrics["tokens_per_s"] = self.batch_tokens / elapsed
        metrics["step_s"] = elapsed
        metrics.update(self._throughput(elapsed))
        metrics["step"] = self.iteration
        return metrics

    def _throughput(self, elapsed: float) -> Dict[str, float]:
        """Model TFLOP/s per GPU of a step that took ``elapsed`` seconds and, with a hardware
        profile, its MFU (:func:`rmt.training.fit.step_prediction`)."""
        per_token = self.prediction["flops_per_token"]
        if per_token is None:
            return {}
        achieved = per_token * self.batch_tokens / self.world_size / elapsed
        out = {"tflops_per_gpu": achieved / 1e12}
        if self.prediction["peak_flops"]:
            out["mfu"] = achieved / self.prediction["peak_flops"]
        return out

    def gather_weights(self) -> None:
        """With ``train.overlap_param_gather`` the distributed optimizer's updated weights reach
        the parameters bucket by bucket during the next step's forward, and host-memory value
        tables step on a thread of their own: gather and finish them all now (before an
        evaluation, a checkpoint, the end of training)."""
        self.memory.settle()
        if self.config.train.overlap_param_gather:
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)

    def evaluate_average(self) -> float:
        """:meth:`evaluate` of the weight average (``train.ema_decay``)."""
        with self.average.swapped_in():
            return self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss (cross-entropy) over ``eval_iters`` fixed global batches, in eval
        mode (no dropout; BatchNorm on its running statistics)."""
        t = self.config.train
        total = 0.0
        self.gather_weights()
        for chunk in self.chunks:
            chunk.eval()
        try:
            for i in range(t.eval_iters):
                losses = self._run_schedule("valid", i * self.global_batch, forward_only=True)
                total += float(losses[LOSSES.index("lm loss")])
        finally:
            for chunk in self.chunks:
                chunk.train()
        return total / t.eval_iters

    def after_evaluation(self, metrics: Dict) -> None:
        """React to ``metrics["val_loss"]``: the task curriculum (:mod:`rmt.data.tasks`, which
        records ``noise_length``), then the learning rate's factor (:mod:`rmt.training.lr_control`,
        recorded as ``lr_scale``), applied from the next step."""
        changed, at_target = self.data.after_evaluation(metrics)
        if changed and self.average is not None:
            self.average.restart()  # the shorter stage's weights are not what the longer one averages
        scale = self.lr_control.update(metrics["val_loss"], changed, at_target)
        if scale != self.scheduler.scale:
            self.scheduler.scale = scale
            self.scheduler.step(0)
        metrics["lr_scale"] = scale

    def save(self) -> str:
        self.gather_weights()
        common = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "global_batch_size": self.global_batch,
            "config": rmt_config.to_dict(self.config),
            "run_name": self.run_name,
            "tokenizer_json": self.data.tokenizer_json(),
            "lr_control": self.lr_control.state_dict(),
        }
        data_state = self.data.state_dict()  # e.g. a task curriculum's noise length
        if data_state is not None:
            common["data_state"] = data_state
        self.last_save = checkpoint.save_checkpoint(
            self.config.train.save,
            self.iteration,
            self.chunks,
            self.optimizer,
            common,
            self.config.train.keep_checkpoints,
            self.average.by_param() if self.average is not None else None,
        )
        self.say(f"checkpoint saved to '{self.last_save}'")
        return self.last_save

    # -- loop ----------------------------------------------------------------------------
    def train(self) -> List[Dict]:
        t = self.config.train
        start, first_step = time.perf_counter(), self.iteration
        writer = None
        if self.is_logger and t.tensorboard_dir:
            writer = open_tensorboard(run_log_dir(t.tensorboard_dir, self.run_name), self.iteration)
            self.say(f"TensorBoard logs: '{writer.log_dir}' (tensorboard --logdir {t.tensorboard_dir})")
        log = None
        if self.is_logger and t.log_file:
            log, dropped = open_jsonl(t.log_file, self.iteration)
            if dropped:
                self.say(
                    f"'{t.log_file}': dropped {dropped} entries after step {self.iteration} "
                    f"that an interrupted run logged (they are run again)"
                )
        if self.is_logger and t.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=t.steps, initial=self.iteration, desc="train", unit="step", dynamic_ncols=True)
        try:
            while self.iteration < t.steps:
                m = self.train_step()
                if t.eval_iters and (self.iteration % t.eval_interval == 0 or self.iteration == t.steps):
                    m["val_loss"] = self.evaluate()
                    if self.average is not None:
                        m["val_loss_ema"] = self.evaluate_average()
                    self.after_evaluation(m)
                if self.iteration % t.log_interval == 0:
                    m.update(self.memory.pop_stats())
                self.history.append(m)
                if self.is_logger:
                    _emit(m, writer, log, self._bar, self.iteration % t.log_interval == 0 or "val_loss" in m)
                self.stopped_by = preemption.agreed_signal()
                stop = bool(t.exit_interval) and self.iteration % t.exit_interval == 0
                if t.save and (
                    stop
                    or self.stopped_by
                    or self.iteration == t.steps
                    or (t.save_interval and self.iteration % t.save_interval == 0)
                ):
                    self.save()
                if stop or self.stopped_by:
                    break
        finally:
            for h in (self._bar, writer, log):
                if h is not None:
                    h.close()
            self._bar = None
        self.gather_weights()
        self._summary(self.iteration - first_step, time.perf_counter() - start, writer)
        return self.history

    def _summary(self, steps: int, seconds: float, writer) -> None:
        t = self.config.train
        if self.stopped_by:
            head = f"stopped on {self.stopped_by} after step {self.iteration} of {t.steps}"
        elif self.iteration < t.steps:
            head = f"stopped at step {self.iteration} of {t.steps} (train.exit_interval)"
        else:
            head = f"finished: step {self.iteration} of {t.steps}"
        where = f"; checkpoint '{self.last_save}'" if self.last_save else "; no checkpoint saved"
        more = "; run the same command to continue" if self.iteration < t.steps and self.last_save else ""
        self.say(head + where + more)
        self.say(
            f"  this run: {steps} steps, {self.tokens_this_run:,} tokens in {seconds:.1f} s "
            f"({self.tokens_this_run / max(seconds, 1e-9):,.0f} tokens/s)"
        )
        timed = sorted(m["step_s"] for m in self.history if "step_s" in m)
        if timed:
            median = timed[len(timed) // 2]
            predicted = self.prediction["predicted_step_s"]
            self.say(
                f"  step time: median {median * 1e3:,.1f} ms"
                + (
                    f", predicted {predicted * 1e3:,.1f} ms by rmt-plan time on {self.prediction['profile']}"
                    if predicted
                    else " (no hardware profile for a prediction: rmt-plan calibrate)"
                )
            )
        vals = [m for m in self.history if "val_loss" in m]
        ema = f" (weight average {vals[-1]['val_loss_ema']:.4f})" if vals and "val_loss_ema" in vals[-1] else ""
        self.say(
            f"  final validation loss {vals[-1]['val_loss']:.4f}{ema} at step {vals[-1]['step']}"
            if vals
            else "  no validation loss (train.eval_iters is 0)"
            if not t.eval_iters
            else "  no validation loss this run"
        )
        if writer is not None:
            self.say(f"  TensorBoard: '{writer.log_dir}'")
        if t.log_file:
            self.say(f"  metrics log: '{t.log_file}'")


def _emit(m: Dict, writer, log, bar, verbose: bool) -> None:
    step = m["step"]
    if writer is not None:
        for k in (
            "loss",
            "lm loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "tflops_per_gpu",
            "mfu",
            "val_loss",
            "val_loss_ema",
        ):
            if k in m and math.isfinite(m[k]):
                name = {"val_loss": "valid/loss", "val_loss_ema": "valid/loss_ema"}.get(
                    k, f"train/{k.replace(' ', '_')}"
                )
                writer.add_scalar(name, m[k], step)
        for k in m:
            if k.startswith("memory/"):
                writer.add_scalar(k, m[k], step)
    if log is not None:
        log.write(json.dumps(m) + "\n")
        log.flush()
    line = None
    if verbose:
        val = f" val_loss {m['val_loss']:.4f}" if "val_loss" in m else ""
        val += f" val_loss_ema {m['val_loss_ema']:.4f}" if "val_loss_ema" in m else ""
        line = (
            f"step {step:5d} loss {m['lm loss']:.4f}{val} lr {m['lr']:.3e} "
            f"grad_norm {m['grad_norm']:.3f} tok/s {m['tokens_per_s']:.0f}"
            + (f" TFLOP/s/GPU {m['tflops_per_gpu']:.3g}" if "tflops_per_gpu" in m else "")
            + (f" MFU {m['mfu']:.1%}" if "mfu" in m else "")
        )
    if bar is not None:
        bar.set_postfix(loss=f"{m['lm loss']:.4f}", lr=f"{m['lr']:.2e}", refresh=False)
        bar.update(1)
        if line:
            bar.write(line)
    elif line:  # no bar (batch jobs): the periodic lines still go to the job's log
        print(line, flush=True)
