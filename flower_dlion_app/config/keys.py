"""Every run-config key of the repository app, in groups: its default and what it means (the one source)."""

from __future__ import annotations

from typing import Any, NamedTuple


class Key(NamedTuple):
    """One run-config key: its default (whose type every value must have) and what it means."""

    default: Any
    meaning: str


class Group(NamedTuple):
    """Keys that belong together, and what they are about."""

    about: str
    keys: dict[str, Key]


GROUPS: dict[str, Group] = {
    "algorithm": Group(
        "what is trained and how: the strategy (D-Lion or a baseline), its model and its optimizer",
        {
            "num-server-rounds": Key(200, "rounds of training"),
            "strategy": Key(
                "dlion-vote",
                (
                    "`dlion-vote` (Δ = sign(Σδ), 0 on a tie), `dlion-mean` (Δ = Σδ/n), or a baseline: `signsgd-vote`,"
                    " `global-lion`, `global-adamw`, `terngrad`, `fedavg`, `fedprox`, `fedadam`, `fedyogi`, "
                    "`scaffold`, `fedmedian`, `fedtrimmedavg`, `krum`, `multikrum`, `bulyan`"
                ),
            ),
            "model": Key(
                "cnn",
                (
                    "the repository app's model: for `fashion-mnist`, `cnn` (281,034 parameters, no BatchNorm) or "
                    "`cnn-bn` (the same with BatchNorm after each convolution, 281,130); for `shakespeare`, "
                    "`char-lstm` (McMahan et al.'s LSTM, 820,185) or `char-transformer` (a char-level decoder-only "
                    "transformer, tied embeddings)"
                ),
            ),
            "lr": Key(0.002, "learning rate (server and replicas; FedAvg: the clients' SGD)"),
            "lr-schedule": Key(
                "constant",
                (
                    "D-Lion and FedAvg family: `cosine` decays `lr` over `num-server-rounds` to `lr-final` × `lr` "
                    "(`lion.cosine_decay`; round t's rate drives its local steps and its Δ, and each Δ is sent with "
                    "its rate); the anchored downlink needs `constant` (`auto` then uses the chain); a resumed run "
                    "with a larger `num-server-rounds` stretches the rest of the decay"
                ),
            ),
            "lr-final": Key(0.0, "with `lr-schedule` = `cosine`: the factor of `lr` reached at the end, in [0, 1]"),
            "weight-decay": Key(0.1, "decoupled weight decay: x ← x − lr·(Δ + wd·x) (AdamW: decoupled; SGD: L2)"),
            "beta1": Key(0.9, "Lion interpolation for the direction (AdamW: β₁)"),
            "beta2": Key(0.99, "Lion momentum decay (AdamW: β₂)"),
            "local-steps": Key(
                1,
                (
                    "D-Lion family: K Lion steps per round on the client's own copy of x; it uploads U = Σₖ δₖ (see "
                    "`upload`) and the server applies Δ = K·sign(ΣUᵢ) (vote) or ΣUᵢ/n (mean) with K steps' weight "
                    "decay"
                ),
            ),
            "local-optimizer": Key(
                "lion",
                (
                    "D-Lion family: `lion`, the K local steps are Lion steps at `lr`; `sgd` (FedSMU-style), K plain "
                    "SGD steps at `local-lr`, then one Lion step on their model change g = x − x_K: δ = sign(β₁·m + "
                    "(1−β₁)·g), m ← β₂·m + (1−β₂)·g, and the server counts one step (`upload` = `sign`); with "
                    "`upload` = `ef-sign` the client sends g itself as a scaled sign with error feedback (with `lr` "
                    "= 1 and `weight-decay` = 0: FedAvg's update, compressed to 1 bit each way)"
                ),
            ),
            "local-lr": Key(
                0.0,
                (
                    "the local SGD learning rate of `local-optimizer` = `sgd` (required there; Lion's local steps use"
                    " `lr`)"
                ),
            ),
            "local-proximal-mu": Key(
                0.0,
                (
                    "D-Lion family, `local-steps` > 1: drift control, each local gradient gains μ·(x_local − x), "
                    "pulling the client's copy toward the round's x; 0 = off"
                ),
            ),
            "drift-correction": Key(
                "off",
                (
                    "D-Lion family, the 1-bit SGD mode (`local-optimizer` = `sgd`, `upload` = `ef-sign`, "
                    "`strategy` = `dlion-mean`, `broadcast-bits` ≥ 1, no `server-momentum`): `scaffold` runs each "
                    "local SGD step on g + c − cᵢ, SCAFFOLD's control variates with c the last broadcast and cᵢ the "
                    "client's own (no extra payload byte, 8 bytes a scale block in each train message's config; "
                    "about 4 bytes a parameter on each client); `off` = today's client"
                ),
            ),
            "stale-momentum": Key(
                "keep",
                (
                    "D-Lion family: a client sampled again after missing k rounds keeps its momentum, decays it "
                    "(`decay`: m ← β₂ᵏ·m, as k rounds without gradients) or resets it (`reset`)"
                ),
            ),
            "accumulate": Key(1, "D-Lion family: minibatches averaged into each local gradient"),
            "upload": Key(
                "sign",
                (
                    "`sign`: sign(U), 1 bit; `sum`: U itself, ⌈log₂(2K+1)⌉ bits (FedLion); `ef-sign`: scaled sign of "
                    "U + e with one float32 scale per tensor, e kept in `context.state` (error feedback)"
                ),
            ),
            "broadcast-bits": Key(
                0,
                (
                    "0: Δ broadcast exactly as levels; p ≥ 1: Δ + e quantized to a scaled sign (p = 1) or 2ᵖ − 1 "
                    "levels, e kept on the server"
                ),
            ),
            "scale-block": Key(
                0,
                (
                    "D-Lion family with `upload` = `ef-sign` or `broadcast-bits` ≥ 1: B > 0 gives one float32 scale "
                    "per B values of each tensor (Lion Cub's per-block scales; 4 bytes more per B values, each way) "
                    "instead of one per tensor"
                ),
            ),
            "sign-noise": Key(
                0.0,
                (
                    "D-Lion family, `upload` = `sign` or `ef-sign`: τ of stochastic signs, sign(v + τ·mean|v|·ξ) per "
                    "tensor (less bias under skew, more variance; flower_dlion.stochastic); 0: deterministic"
                ),
            ),
            "sign-noise-kind": Key("uniform", "the stochastic signs' noise ξ: `uniform` on [−1, 1] or `gaussian`"),
            "server-momentum": Key(
                0.0,
                (
                    "D-Lion family: μ of a Nesterov momentum on the server's Δ before the quantized broadcast "
                    "(DiLoCo's outer optimizer): M ← μ·M + Δ, broadcast Δ + μ·M; needs `broadcast-bits` ≥ 1; 0 = off"
                ),
            ),
            "momentum-sync-every": Key(
                0,
                (
                    "every R rounds clients also upload their momentum (float32) and the next round sends them the "
                    "average (Lion Cub); 0 = never"
                ),
            ),
            "momentum-sync-layers": Key(
                "", "comma-separated parameter-name prefixes whose momentum is synchronized; empty = all"
            ),
            "init": Key(
                "seed",
                (
                    "`seed`: a new client builds x₀ from `seed` (checked by checksum; the full model if it differs) "
                    "instead of downloading it; `full`: it downloads it"
                ),
            ),
            "downlink": Key(
                "auto",
                (
                    "`anchored`: x = γ·xₐ − η·C, a stale client gets the coded counts since its version (a vote with "
                    "`broadcast-bits` = 0 only); `chain`: the missed Δs one by one; `auto`: anchored where it applies"
                ),
            ),
            "anchor-every": Key(
                200,
                (
                    "rounds between anchors of the anchored downlink (xₐ ← x, C ← 0); `anchor-every` × `local-steps` "
                    "≤ 2²⁰"
                ),
            ),
            "secure": Key(
                False,
                (
                    "secure aggregation: clients upload their signs under pairwise masks, ⌈log₂(n+1)⌉ bits a "
                    "parameter; the server learns the counts, not one client's signs "
                    "(docs/USER_GUIDE.md, Secure aggregation)"
                ),
            ),
            "secure-degree": Key(0, "neighbours each client masks with (SecAgg+'s graph); 0: every other participant"),
        },
    ),
    "baselines": Group(
        "the FedAvg family's own keys (its clients' SGD, FedProx, FedAdam / FedYogi)",
        {
            "momentum": Key(
                0.9,
                (
                    "Signum's β (`signsgd-vote`), the server SGD momentum (`terngrad`), the clients' SGD momentum "
                    "(`fedavg`)"
                ),
            ),
            "local-epochs": Key(1, "`fedavg`: local epochs over the client's partition per round"),
            "local-batches": Key(0, "`fedavg`: only the first k minibatches of each local epoch (0 = whole epochs)"),
            "proximal-mu": Key(0.01, "`fedprox`: μ of the clients' proximal term μ/2·‖w − x‖²"),
            "server-lr": Key(
                0.01,
                (
                    "`fedadam`, `fedyogi`: the server step η on the mean model change (their β₁, β₂ are `beta1`, "
                    "`beta2`)"
                ),
            ),
            "server-tau": Key(0.001, "`fedadam`, `fedyogi`: τ, the adaptivity constant of the server step"),
        },
    ),
    "data": Group(
        "the data and how it is split over the clients",
        {
            "dataset": Key(
                "fashion-mnist",
                (
                    "`fashion-mnist` (28×28 images, 10 classes) or `shakespeare` (LEAF's next-character task: each "
                    "speaking role of a play is a client; `flower_dlion_app/tasks.py`)"
                ),
            ),
            "batch-size": Key(64, "samples per client per round (one gradient per round); FedAvg's local batch"),
            "partitioner": Key(
                "dirichlet",
                (
                    "`fashion-mnist`: `iid`, `dirichlet`, `pathological`, `shard` (flwr-datasets partitioners); "
                    "`shakespeare`: `natural` (one role a client) or `iid` (the control: the roles' sizes, windows "
                    "shuffled)"
                ),
            ),
            "alpha": Key(0.5, "Dirichlet concentration (smaller = more skewed)"),
            "classes-per-partition": Key(2, "classes per client for `pathological`, shards for `shard`"),
            "seed": Key(0, "seeds the model init, the partitions and every client's minibatches"),
            "holdout": Key(
                0,
                (
                    "keep the last k training images from the clients and evaluate on them instead of the test set "
                    "(for tuning); `shakespeare`: k test windows other than the test set's"
                ),
            ),
            "data-dir": Key("", "a folder with the Fashion-MNIST IDX files (or torchvision's `FashionMNIST/raw`)"),
        },
    ),
    "runtime": Group(
        "sampling, evaluation, devices and timing",
        {
            "fraction-train": Key(1.0, "fraction of connected nodes sampled each round"),
            "min-train-nodes": Key(
                2, "at least this many nodes are sampled each round (as Flower's `min_train_nodes`)"
            ),
            "min-available-nodes": Key(
                2, "wait for this many connected nodes before round 1 (1 for a one-node federation)"
            ),
            "min-replies": Key(1, "fewer valid replies than this: the round applies no update"),
            "wait-for-nodes": Key(
                120.0,
                (
                    "D-Lion family and global optimizers: seconds a round waits for `min-available-nodes` connected "
                    "nodes (secure aggregation: `min-train-nodes`, at least 3, that can take part) before the run "
                    "stops naming both counts (`summary.json` status `stopped`); 0: stop at once; raise it for a "
                    "deployment whose SuperNodes start later"
                ),
            ),
            "max-failed-rounds": Key(
                3,
                (
                    "the run stops with an error (`summary.json` status `stopped`, the reasons logged) after this "
                    "many rounds in a row with fewer than `min-replies` valid replies (FedAvg family: none; replies "
                    "with non-finite arrays are dropped); 0: never"
                ),
            ),
            "divergence-factor": Key(
                10.0,
                (
                    "D-Lion family: f > 1; a WARNING names the round, its train loss Lₜ, the running minimum "
                    "mₜ = min over earlier rounds, f and the nodes when Lₜ > f·mₜ for `divergence-rounds` rounds in "
                    "a row, or when a node's train loss is not finite; `inf`: non-finite losses only"
                ),
            ),
            "divergence-rounds": Key(1, "D-Lion family: R ≥ 1, the rounds in a row with Lₜ > f·mₜ before that warning"),
            "stop-on-divergence": Key(
                False,
                "D-Lion family: `true` stops the run at that warning (`summary.json` status `stopped`, reason logged)",
            ),
            "eval-every": Key(20, "evaluate x on the 10,000 test images every k rounds (and at 0 and the end)"),
            "device": Key("auto", "`auto` (CUDA when available), `cpu` or `cuda` for the clients"),
            "round-timeout": Key(
                3600.0, "seconds to wait for replies in a round (and for hellos); late clients are left out"
            ),
            "poll-interval": Key(
                0.0,
                (
                    "seconds between the ServerApp's pulls for replies; 0: the Grid's own (3 s on the Deployment "
                    "Engine, 0.1 s in simulation); shorter did not shorten rounds (*Edge devices*)"
                ),
            ),
            "momentum-dtype": Key(
                "float32",
                (
                    "D-Lion family: `bfloat16` keeps the momentum in `context.state` at 2 bytes per value (rounded "
                    "once per round)"
                ),
            ),
            "max-resident": Key(
                -1,
                (
                    "D-Lion family: nodes whose state a client process keeps on its device between messages; "
                    "-1: as many as fit in a quarter of the device's memory, 0: none"
                ),
            ),
            "max-local-batches": Key(
                1000,
                (
                    "D-Lion family: the most batches a client takes in one round (`local-steps` × `accumulate`); a "
                    "server message asking for more is refused (`DLionClient(max_batches=...)`)"
                ),
            ),
            "link-mbps": Key(
                0.0,
                (
                    "D-Lion family: the clients' downlink in Mbit/s; they ask for Δs coded with the two before "
                    "them as context (~20 % fewer bytes down) while the decode takes less time than the bytes "
                    "saved; 0: unknown, never"
                ),
            ),
        },
    ),
    "faults": Group(
        "the fault study: failing and Byzantine clients",
        {
            "fail-fraction": Key(
                0.0, "fault study: each sampled client raises with this probability (seeded by seed, partition, round)"
            ),
            "byzantine-fraction": Key(
                0.0, "fault study: partitions 0 … k−1, k = ⌊f·n + ½⌋, attack (D-Lion family and `fedavg`)"
            ),
            "byzantine-mode": Key(
                "flip",
                (
                    "`flip`: upload −U (FedAvg family: x − s·u); `random`: random signs (FedAvg family: a random "
                    "update of norm s·‖u‖); D-Lion family only: `scale` (−U with its ef-sign scales × s), `momentum` "
                    "(−U, and −s·sign(m) as its synced momentum), `little` (U with the signs of its least certain "
                    "half flipped); see `clients/attacks.py`"
                ),
            ),
            "byzantine-scale": Key(
                1.0, "s: the FedAvg family's attack scale, the factor of the `scale` and `momentum` lies"
            ),
        },
    ),
    "persistence": Group(
        "results, checkpoints and the clients' state between rounds",
        {
            "results-dir": Key(
                "", "where to write results; empty = `~/flower-dlion/runs/<UTC time>-run<id>` (printed at start)"
            ),
            "checkpoint-every": Key(
                0, "write `checkpoint.pt` every K rounds and after the last (not for `fedavg`); 0 = never"
            ),
            "resume": Key("", "path of a `checkpoint.pt` to go on from"),
            "client-state-dir": Key(
                "",
                (
                    "D-Lion family: where clients keep their state files (survives SuperNode restarts; exact "
                    "resumes; shared storage on a Ray cluster); empty: $FLOWER_DLION_STATE_DIR, else a temporary folder"
                ),
            ),
            "state-in-context": Key(
                False,
                (
                    "D-Lion family: `true` keeps the clients' state in `context.state` (follows a client across the "
                    "machines of a Ray cluster without shared storage; ~9 B a parameter of memory for every client "
                    "touched)"
                ),
            ),
        },
    ),
}

DEFAULTS: dict[str, Any] = {name: key.default for group in GROUPS.values() for name, key in group.keys.items()}

# Flower's FedAvg, its robust aggregators, FedProx and the adaptive server optimizers (FedAdam,
# FedYogi): the same client (local SGD epochs, the model out)
FEDOPT = ("fedadam", "fedyogi")
FEDAVG_FAMILY = (
    "fedavg",
    "fedprox",
    *FEDOPT,
    "scaffold",
    "fedmedian",
    "fedtrimmedavg",
    "krum",
    "multikrum",
    "bulyan",
)
STRATEGIES = ("dlion-vote", "dlion-mean", "signsgd-vote", "global-lion", "global-adamw", "terngrad", *FEDAVG_FAMILY)

BYZANTINE_MODES = ("flip", "random", "scale", "momentum", "little")  # clients/attacks.py

_CHOICES = {
    "strategy": STRATEGIES,
    "model": ("cnn", "cnn-bn", "char-lstm", "char-transformer"),  # model.MODELS
    "dataset": ("fashion-mnist", "shakespeare"),  # tasks.DATASETS
    "partitioner": ("iid", "dirichlet", "pathological", "shard", "natural"),
    "device": ("auto", "cpu", "cuda"),
    "upload": ("sign", "sum", "ef-sign"),
    "local-optimizer": ("lion", "sgd"),
    "stale-momentum": ("keep", "decay", "reset"),
    "drift-correction": ("off", "scaffold"),
    "lr-schedule": ("constant", "cosine"),
    "init": ("full", "seed"),
    "downlink": ("auto", "anchored", "chain"),
    "sign-noise-kind": ("uniform", "gaussian"),
    "byzantine-mode": BYZANTINE_MODES,
    "momentum-dtype": ("float32", "bfloat16"),
}

DLION_STRATEGIES = ("dlion-vote", "dlion-mean", "signsgd-vote")
# Keys that only the Distributed Lion family reads; their defaults turn them off.
DLION_ONLY = (
    "divergence-factor",
    "divergence-rounds",
    "stop-on-divergence",
    "max-resident",
    "max-local-batches",
    "link-mbps",
    "client-state-dir",
    "state-in-context",
    "momentum-dtype",
    "local-steps",
    "local-optimizer",
    "local-lr",
    "local-proximal-mu",
    "drift-correction",
    "stale-momentum",
    "accumulate",
    "upload",
    "broadcast-bits",
    "scale-block",
    "sign-noise",
    "sign-noise-kind",
    "server-momentum",
    "momentum-sync-every",
    "momentum-sync-layers",
    "init",
    "downlink",
    "anchor-every",
    "secure",
    "secure-degree",
)
