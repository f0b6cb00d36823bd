"""The gradient baselines: clients send gradients, the server averages them and steps.

Global Lion and global AdamW (fp32 gradients, 32 bits per parameter each way) and
TernGrad (ternary gradients with a per-tensor scaler up, fp32 model down; server SGD with
momentum). The reference points Distributed Lion is measured against (Liu et al., 2024).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any, Literal

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from flower_dlion import codec, lion, quantizers
from flower_dlion.lion import check_hyperparameters
from flower_dlion.params import layout_fingerprint
from flower_dlion.protocol import RejectedReply, check_envelope, float_array, read_metrics
from flower_dlion.strategies.common import ServerModelStrategy
from flower_dlion_app.protocol import GRAD_CONFIG, GRAD_METRICS, GRAD_MODEL, GRAD_UPDATE, TERNGRAD_STYPE

__all__ = ["GlobalOptimizer"]

Optimizer = Literal["lion", "adamw", "sgd"]
Encoding = Literal["fp32", "terngrad"]


class GlobalOptimizer(ServerModelStrategy):
    r"""Average the clients' gradients on the server and take one optimizer step.

    Every round each sampled client receives the full model x (float32), computes the
    gradient of its loss on one minibatch, and sends it back (``encoding``); the server
    averages the n valid gradients ``ĝ = (1/n) Σᵢ gᵢ`` and steps:

    * ``optimizer="lion"``: ``x ← x − lr·(sign(β₁·m + (1−β₁)·ĝ) + wd·x)``,
      ``m ← β₂·m + (1−β₂)·ĝ`` (``lion.lion_step_``, the function the D-Lion clients use);
    * ``optimizer="adamw"``: ``torch.optim.AdamW`` with betas (β₁, β₂);
    * ``optimizer="sgd"``: ``torch.optim.SGD`` with ``momentum`` (TernGrad's optimizer).

    With ``encoding="terngrad"`` the clients send TernGrad's stochastic ternary gradient
    (``quantizers.ternarize``: one float32 scaler per tensor plus 1.6 bits per value) and
    the server averages the unbiased estimates ``sⱼ·tⱼ``.

    Parameters
    ----------
    optimizer : {"lion", "adamw", "sgd"} (default: "lion")
        The server's optimizer.
    encoding : {"fp32", "terngrad"} (default: "fp32")
        How clients send gradients.
    lr : float (default: 1e-3)
        Learning rate.
    weight_decay : float (default: 0.0)
        Decoupled (Lion, AdamW) or L2 (SGD) weight decay.
    beta1, beta2 : float (default: 0.9, 0.99)
        Lion's or AdamW's betas.
    momentum : float (default: 0.9)
        SGD momentum.
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled each round.
    min_train_nodes : int (default: 2)
        Minimum number of nodes sampled each round.
    min_available_nodes : int (default: 2)
        Wait until this many nodes are connected before sampling.
    min_replies : int (default: 1)
        A round with fewer valid replies applies no update.
    max_failed_rounds : int (default: 3)
        After this many rounds in a row with fewer than ``min_replies`` valid replies the run
        stops: ``aggregate_train`` raises :class:`~flower_dlion.strategies.run_stops.RunStopped`
        naming the rounds and why the replies were rejected (the history keeps the last round);
        a round with enough valid replies resets the count. 0 never stops.
    wait_for_nodes : float | None (default: None)
        Seconds a round waits for ``min_available_nodes`` connected nodes before the run stops
        naming both counts; None: the round timeout.
    sample_seed : int (default: 0)
        Seed of the partition sampling (round t samples with ``default_rng([seed, t])``).

    Examples
    --------
    >>> strategy = GlobalOptimizer(optimizer="adamw", lr=1e-3, weight_decay=0.01)
    >>> result = strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=100)

    References
    ----------
    B. Liu et al., "Communication Efficient Distributed Training with Distributed Lion", 2024;
    W. Wen et al., "TernGrad", NeurIPS 2017.

    """

    def __init__(
        self,
        *,
        optimizer: Optimizer = "lion",
        encoding: Encoding = "fp32",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        beta1: float = 0.9,
        beta2: float = 0.99,
        momentum: float = 0.9,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        min_replies: int = 1,
        sample_seed: int = 0,
        max_failed_rounds: int = 3,
        wait_for_nodes: float | None = None,
    ) -> None:
        if optimizer not in ("lion", "adamw", "sgd"):
            raise ValueError(f"optimizer must be 'lion', 'adamw' or 'sgd', got {optimizer!r}")
        if encoding not in ("fp32", "terngrad"):
            raise ValueError(f"encoding must be 'fp32' or 'terngrad', got {encoding!r}")
        super().__init__(
            fraction_train=fraction_train,
            min_train_nodes=min_train_nodes,
            min_available_nodes=min_available_nodes,
            min_replies=min_replies,
            sample_seed=sample_seed,
            max_failed_rounds=max_failed_rounds,
            wait_for_nodes=wait_for_nodes,
        )
        check_hyperparameters(
            lr=lr,
            weight_decay=weight_decay,
            betas={"beta1": beta1, "beta2": beta2, "momentum": momentum},
        )
        self.optimizer = optimizer
        self.encoding = encoding
        self.lr = lr
        self.weight_decay = weight_decay
        self.beta1 = beta1
        self.beta2 = beta2
        self.momentum = momentum

        self._sizes: list[int] = []
        self._m: torch.Tensor | None = None  # Lion momentum (optimizer="lion")
        self._torch_opt: torch.optim.Optimizer | None = None
        self._param: torch.nn.Parameter | None = None
        self._sent: dict[int, int] = {}  # node id → round, for the round in progress
        self._open_round = 0
        self.history: list[dict[str, Any]] = []

    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "\t├──> Global %s on averaged %s gradients", self.optimizer, self.encoding)
        log(
            INFO,
            "\t│\t└──lr=%g | weight_decay=%g | beta1=%g | beta2=%g | momentum=%g",
            self.lr,
            self.weight_decay,
            self.beta1,
            self.beta2,
            self.momentum,
        )
        self._log_sampling()

    def _init_model(self, arrays: ArrayRecord) -> None:
        super()._init_model(arrays)
        assert self.x is not None
        self._sizes = self.sizes
        if self.optimizer == "lion":
            self._m = torch.zeros_like(self.x)
        else:
            self._param = torch.nn.Parameter(self.x, requires_grad=False)  # shares storage with x
            if self.optimizer == "adamw":
                self._torch_opt = torch.optim.AdamW(
                    [self._param], lr=self.lr, betas=(self.beta1, self.beta2), weight_decay=self.weight_decay
                )
            else:
                self._torch_opt = torch.optim.SGD(
                    [self._param], lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
                )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes and send each one the full model."""
        if self.x is None:
            self._init_model(arrays)
        assert self.x is not None
        node_ids = self._sample(grid, server_round)
        round_config = ConfigRecord(dict(config))
        round_config.update(
            {"server-round": server_round, "encoding": self.encoding, "layout": layout_fingerprint(self._layout)}
        )
        content = RecordDict({GRAD_CONFIG: round_config, GRAD_MODEL: ArrayRecord({"x": Array(self.x.numpy().copy())})})
        self._open_round = server_round
        self._sent = dict.fromkeys(node_ids, server_round)
        self._outbox = [
            Message(content=content, dst_node_id=node_id, message_type=MessageType.TRAIN, group_id=str(server_round))
            for node_id in node_ids
        ]
        return self._outbox

    def _check_reply(self, msg: Message, server_round: int) -> tuple[torch.Tensor, dict[str, float]]:
        """Validate one reply; return (decoded gradient, metrics) or raise RejectedReply."""
        check_envelope(msg, self._sent, server_round, (GRAD_UPDATE, GRAD_METRICS))
        record = msg.content[GRAD_UPDATE]
        if not isinstance(record, ArrayRecord) or list(record.keys()) != ["payload"]:
            raise RejectedReply(f"'{GRAD_UPDATE}' must be an ArrayRecord holding one Array 'payload'")
        arr = record["payload"]
        d = self.num_parameters
        if self.encoding == "fp32":
            g = torch.from_numpy(float_array(arr, (d,), "payload").copy())
        else:
            if arr.stype != TERNGRAD_STYPE or tuple(arr.shape) != (d,):
                raise RejectedReply(f"payload is {arr.stype!r} {tuple(arr.shape)}, expected {TERNGRAD_STYPE!r} ({d},)")
            num_scales = 4 * len(self._sizes)
            expected = num_scales + codec.encoded_size(d, 3)
            if len(arr.data) != expected:
                raise RejectedReply(f"{len(arr.data)} payload bytes, expected {expected}")
            scales = torch.from_numpy(np.frombuffer(arr.data[:num_scales], dtype=np.float32).copy())
            if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
                raise RejectedReply("TernGrad scalers must be finite and >= 0")
            try:
                levels = codec.decode_levels(arr.data[num_scales:], 3, d)
            except ValueError as err:
                raise RejectedReply(str(err)) from err
            g = quantizers.unternarize(levels, scales, self._sizes)
        if not bool(torch.isfinite(g).all()):
            raise RejectedReply("gradient has non-finite values")
        return g, read_metrics(msg.content, GRAD_METRICS, ("num-examples", "train-loss"))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies, average their gradients and take one optimizer step."""
        if self.x is None or server_round != self._open_round:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train for that round")
        checked = self._check_and_log_replies(server_round, replies, lambda msg: self._check_reply(msg, server_round))
        total: torch.Tensor | None = None
        for g, _ in checked.valid:
            total = g if total is None else total.add_(g)
        n = len(checked.valid)
        losses = [values["train-loss"] for _, values in checked.valid]
        examples = [values["num-examples"] for _, values in checked.valid]
        applied = n >= self.min_replies and total is not None
        if applied:
            self._step(total.div_(n))  # ĝ = (1/n) Σ gᵢ
        else:
            log(WARNING, "round %d: %d valid replies < min_replies=%d, x unchanged", server_round, n, self.min_replies)
        num_examples = sum(examples)
        metrics = {
            "num-replies": n,
            "num-rejected": checked.rejected,
            "num-sampled": len(self._sent),
            "applied": int(applied),
            "train-loss": sum(v * e for v, e in zip(losses, examples, strict=True)) / num_examples
            if num_examples
            else math.nan,
            "num-examples": int(num_examples),
        }
        self.history.append({"round": server_round, **metrics})
        missing = len(set(self._sent) - checked.answered)
        why = f"{n} valid of {len(self._sent)} sent ({checked.rejected} rejected, {missing} without a reply)"
        self._sent, self._open_round = {}, 0
        self._round_outcome(server_round, n, why)  # RunStopped after max_failed_rounds failed rounds
        return self.arrays(), MetricRecord(metrics)

    def result_row(self) -> dict[str, int]:
        """The last round's fields for ``results.jsonl`` (see :class:`flower_dlion_app.results.Recorder`)."""
        return {"num_rejected": self.history[-1]["num-rejected"]}

    def state_dict(self) -> dict[str, Any]:
        """x, the optimizer's state and the metrics so far."""
        return super().state_dict() | {
            "m": None if self._m is None else self._m.clone(),
            "torch_opt": None if self._torch_opt is None else self._torch_opt.state_dict(),
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`."""
        super().load_state_dict(state)
        self._init_model(self.arrays())  # x from the checkpoint's values, and the optimizer objects on it
        if state["m"] is not None:
            self._m = state["m"].clone()
        if state["torch_opt"] is not None and self._torch_opt is not None:
            self._torch_opt.load_state_dict(state["torch_opt"])
        self.history = [dict(h) for h in state["history"]]

    def _step(self, g: torch.Tensor) -> None:
        assert self.x is not None
        if self.optimizer == "lion":
            assert self._m is not None
            lion.lion_step_(
                self.x, self._m, g, lr=self.lr, weight_decay=self.weight_decay, beta1=self.beta1, beta2=self.beta2
            )
            return
        assert self._param is not None and self._torch_opt is not None
        self._param.grad = g
        self._torch_opt.step()
