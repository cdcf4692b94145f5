"""Whether the input embedding and the loss head train: an object each holds (`Embedding.training`,
`LossHead.training`), chosen in one place (`choose`, through `Placements.refresh_ends`) from what
their units are: at `slide()`, and again at the start of every forward (`Embedding.forward`),
since `requires_grad` may change after `slide()` without the engine being told (a frozen base
under LoRA does not train; a user may freeze a part between steps). The parts call it and never
ask their unit. A forward's backward does what that forward prepared.

| | `TrainedEmbedding` | `FrozenEmbedding` |
|---|---|---|
| a training forward, the table on the host | makes the dense host gradient | nothing |
| the resident plan | may move the table to the device | keeps it on the host |
| the whole-table update at the worker's front | when the table is on the host | none |
| its backward | the batch rows' sums (`Embedding.take_gradient`) | the backward ends |

| | `TrainedHead` (its own parameters or a tied lm_head's train) | `FrozenHead` |
|---|---|---|
| a training forward | the input's gradient and its own (`LossHead.grads_forward`) | the input's gradient only (`LossHead.input_grad_forward`) |
| the embedding's update in a backward that updates | begun by the head's backward, with its own | begun by the embedding's |

Their update at `optimizer.step()` is chosen at the step, with the layers' (`Placements.updater_of`).
"""
from __future__ import annotations

__all__ = ["TrainedEmbedding", "FrozenEmbedding", "TrainedHead", "FrozenHead", "choose"]


class TrainedEmbedding:
    """The embedding while its unit trains."""

    def prepare_gradient(self, embedding) -> None:
        """A training forward with the table on the host: the dense host gradient, made on first use."""
        embedding.ensure_grad()

    def to_device(self, embedding, wanted=None) -> None:
        """The resident plan may move the table: resident when `wanted()` (if given) agrees."""
        if wanted is None or wanted():
            embedding.make_resident()

    def updates_on_worker(self) -> bool:
        """Does a table on the host take the worker's whole-table update?"""
        return True

    def backward(self, embedding, gx) -> None:
        """The embedding's gradient from the first layer's input gradient `gx`."""
        embedding.take_gradient(gx)


class FrozenEmbedding:
    """The embedding while its unit does not train (the base under LoRA): no gradient, no update."""

    def prepare_gradient(self, embedding) -> None:
        """No gradient to keep."""

    def to_device(self, embedding, wanted=None) -> None:
        """The table stays on the host."""

    def updates_on_worker(self) -> bool:
        """No update."""
        return False

    def backward(self, embedding, gx) -> None:
        """No gradient: the backward ends."""
        embedding.engine.end_backward()


class TrainedHead:
    """The head while it takes gradients (its own parameters, or a tied lm_head's embedding)."""

    def grads_forward(self, head, *args):
        """A training forward: (loss, the input's gradient), its own gradients sent (`LossHead.grads_forward`)."""
        return head.grads_forward(*args)

    def begin_embedding_update(self, engine, unit) -> None:
        """The embedding's update of a backward that updates: begun by the head's backward already."""


class FrozenHead:
    """The head while it takes no gradient (the base under LoRA): the input's gradient only."""

    def grads_forward(self, head, *args):
        """A training forward: (loss, the input's gradient) (`LossHead.input_grad_forward`)."""
        return head.input_grad_forward(*args)

    def begin_embedding_update(self, engine, unit) -> None:
        """The head's backward sent nothing: the embedding's backward begins its unit's update."""
        engine.begin_update(unit)


TRAINED_EMBEDDING, FROZEN_EMBEDDING = TrainedEmbedding(), FrozenEmbedding()
TRAINED_HEAD, FROZEN_HEAD = TrainedHead(), FrozenHead()


def choose(embedding, head) -> None:
    """Give the embedding and the head the training their units have now."""
    embedding.training = TRAINED_EMBEDDING if embedding.unit.trainable else FROZEN_EMBEDDING
    head.training = TRAINED_HEAD if head.trainable else FROZEN_HEAD
