"""The perturbation losses of the semi-supervised literature, and the classifier that trains on
their sum (`PerturbedClassifier`).

Every loss starts the classifier from its embedding layer's output `x` `(B, L, E)` (the word,
pair, triple and position embeddings summed at each position; with either perturbation on, the
tables normalised by their rows' frequencies), and is written from the log-odds `z`
(`p = sigmoid(z)`):

    likelihood                  CE(y, z) = softplus(z) - y z, on the labelled reviews, in training
    adversarial                 CE(y, z(x + r_adv)),  r_adv = epsilon g / ||g||,
    (Miyato, Dai & Goodfellow,  g = d CE(y, z(x)) / d x, each review's `(L, E)` slice its own,
    ICLR 2017)                  stop-gradient; in training (dropout on), as the likelihood
    virtual adversarial         KL(p(x) || p(x + r_vadv)), p(x) stop-gradient, on the labelled
    (Miyato et al., 2017)       and the unlabelled reviews; r_vadv = epsilon g / ||g||,
                                g = d KL(p(x) || p(x + xi d / ||d||)) / d d, one power
                                iteration from d ~ N(0, I) on the tokens; at inference
    entropy minimisation        H(p(x)) = CE(p, z) on the unlabelled reviews, at inference
    (Grandvalet & Bengio, 2005)
    the mixed objective         likelihood + w_adv adversarial + w_vadv virtual adversarial
    (Sachan, Zaheer &                      + w_ent entropy
    Salakhutdinov, AAAI 2019)

The virtual adversarial and entropy passes run at inference (no dropout): the KL of two passes
with different dropout masks is not 0 at `r = 0`, and its gradient would point along the masks'
difference rather than the direction the prediction is most sensitive to.
"""

import dataclasses

import keras
import tensorflow as tf
from keras import ops

from .model import dropped_embeddings, log_odds_from_embeddings

# The power iteration's step, as a norm over a review's whole `(L, E)` embeddings: Miyato et
# al.'s `small_constant_for_finite_diff`. The direction it finds does not depend on its size
# while the KL is quadratic around 0; a review's word embeddings alone have a norm of about
# sqrt(L E) once normalised (each feature's variance 1), 100 at L = 160, E = 64.
XI = 0.1

# The training app's flags that set each field of `Perturbation`.
FLAGS = {
    "adversarial_weight": "adversarial_weight",
    "virtual_adversarial_weight": "virtual_adversarial_weight",
    "entropy_weight": "entropy_weight",
    "perturbation_epsilon": "epsilon",
    "seed": "seed",
}

# The losses each weight adds, in the order the logs show them.
PARTS = {
    "adversarial_weight": "adversarial_loss",
    "virtual_adversarial_weight": "virtual_adversarial_loss",
    "entropy_weight": "entropy",
}


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """The mixed objective's weights and sizes (every weight 0: the likelihood alone).

    `epsilon` is the norm of the adversarial and virtual adversarial perturbations over a
    review's whole embeddings, `xi` the power iteration's step (`XI`), `seed` the random
    directions' (drawn from it and the optimizer's step: a resumed run draws the same)."""

    adversarial_weight: float = 0.0
    virtual_adversarial_weight: float = 0.0
    entropy_weight: float = 0.0
    epsilon: float = 5.0
    xi: float = XI
    seed: int = 0

    @classmethod
    def from_flags(cls, flags):
        """The perturbation a run's flags (`metrics.json`'s `config`, a dict) ask for; a run
        recorded before these flags existed trained on the likelihood alone (the defaults)."""
        return cls(**{field: flags[flag] for flag, field in FLAGS.items() if flag in flags})

    @property
    def weighted(self):
        """`{loss name: weight}` of the losses with a weight above 0."""
        weights = {name: getattr(self, flag) for flag, name in PARTS.items()}
        return {name: weight for name, weight in weights.items() if weight > 0}

    @property
    def normalizes_embeddings(self):
        """Whether the embeddings are perturbed, and so normalised (Miyato et al.)."""
        return self.adversarial_weight > 0 or self.virtual_adversarial_weight > 0

    @property
    def reads_unlabeled(self):
        """Whether a training batch needs unlabelled reviews beside the labelled ones."""
        return self.virtual_adversarial_weight > 0 or self.entropy_weight > 0


def binary_cross_entropy(target, z):
    """`CE(t, z) = -t log sigmoid(z) - (1 - t) log(1 - sigmoid(z))` `(B,)`, from the log-odds
    `z` `(B,)` and a target probability `t` `(B,)`: `softplus(z) - t z`, exact for any `z`
    (the compiled `binary_crossentropy` computes the same from the sigmoid's input)."""
    return ops.softplus(z) - ops.cast(target, z.dtype) * z


def binary_entropy(z):
    """The entropy `H(sigmoid(z))` `(B,)` of the prediction with log-odds `z`: `CE(p, z)`."""
    return binary_cross_entropy(ops.sigmoid(z), z)


def binary_kl(z_from, z_to):
    """`KL(p || q)` `(B,)` between the predictions with log-odds `z_from` (`p`) and `z_to`
    (`q`): `CE(p, z_to) - H(p)`."""
    p = ops.sigmoid(z_from)
    return binary_cross_entropy(p, z_to) - binary_cross_entropy(p, z_from)


def scaled_per_review(v, norm):
    """`norm * v / ||v||` `(B, L, E)`, each review's `(L, E)` slice by its own L2 norm; 0 where
    a review's `v` is. Computed in float32 at least (float64 for float64 `v`), after dividing
    by the largest `|v|` (Miyato et al.'s `_scale_l2`), so that tiny gradients do not
    underflow when squared. Non-finite entries count as 0."""
    dtype = keras.backend.standardize_dtype(v.dtype)
    wide = ops.cast(v, keras.backend.result_type(dtype, "float32"))
    # A gradient that overflowed the loss scale (mixed float16: the optimizer skips that step)
    # gives no perturbation rather than NaN losses in the step's logs.
    wide = ops.where(ops.isfinite(wide), wide, 0.0)
    largest = ops.max(ops.abs(wide), axis=(1, 2), keepdims=True)  # (B, 1, 1)
    wide = wide / ops.maximum(largest, 1e-30)
    length = ops.sqrt(ops.sum(ops.square(wide), axis=(1, 2), keepdims=True))  # (B, 1, 1)
    return ops.cast(norm * wide / ops.maximum(length, 1e-12), dtype)


def adversarial_direction(gradient, epsilon):
    """`r_adv = epsilon g / ||g||` `(B, L, E)` from `g`, the likelihood's gradient with respect
    to the embeddings `(B, L, E)` (stop-gradient), each review's `(L, E)` slice its own norm.
    (The likelihood is the mean of the reviews' losses: each review's slice of `g` is its own
    loss's gradient, divided by `B`, which the norm takes out.)"""
    return scaled_per_review(ops.stop_gradient(gradient), epsilon)


def virtual_adversarial_direction(log_odds_of, x, mask, clean, direction, epsilon, xi, scale=None):
    """`r_vadv` `(B, L, E)`: one power iteration from `direction` `(B, L, E)`, each review's
    norm `epsilon`.

    `log_odds_of(x)` gives the log-odds `(B,)` at embeddings `x` `(B, L, E)`; `clean` `(B,)`
    is it at `x`, `mask` `(B, L)` the tokens (the direction is 0 on padding). Inside a
    `tf.function` (`_gradient`). `scale` multiplies the KL before its gradient is taken (the
    optimizer's loss scale: in float16 the gradient of a KL of about xi^2 would underflow); it
    does not change the direction."""
    token = ops.cast(mask, direction.dtype)[:, :, None]  # (B, L, 1)
    d = ops.cast(scaled_per_review(direction * token, xi), x.dtype)  # (B, L, E)
    kl = ops.sum(binary_kl(ops.stop_gradient(clean), log_odds_of(x + d)))
    return scaled_per_review(_gradient(kl if scale is None else scale(kl), d), epsilon)


def _gradient(loss, x):
    """`d loss / d x`, stop-gradient, built in the graph by `tf.gradients`: inside a
    `tf.function`, as Keras's training step is (not with `run_eagerly`).

    The training step takes all its gradients this way, none from a `tf.GradientTape`. Two
    tapes around a pass, or one persistent tape, make TensorFlow trace the attention's
    branches for gradients of gradients: a tiny classifier's first `fit` with entropy
    minimisation took 38 s (two tapes) and 59 s (one persistent tape) against 9.5 s (one tape);
    with the three losses and `tf.gradients` it takes 17 s, the plain step's 6.9 s (2 shared
    CPU cores). A tape's gradient through a pass that `tf.gradients` has
    differentiated fails (an `AssertionError` in TensorFlow 2.21), and so does a second
    `tf.gradients` through it under a mixed policy (the attention's half-precision dots have no
    registered gradient): each pass is differentiated once (`PerturbedClassifier._objective`)."""
    return ops.stop_gradient(tf.gradients(loss, x)[0])


def _added(a, b):
    """The sum of two gradients of one variable, either None (no path), dense or
    `tf.IndexedSlices` (an embedding's rows): two sets of rows are concatenated, as TensorFlow
    aggregates them (the app's Adam sums repeated rows)."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape
        )
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


@keras.saving.register_keras_serializable(package="apps")
class PerturbedClassifier(keras.Model):
    """`build_classifier`'s model, trained on the mixed objective (the module docstring).

    Build it `around` the classifier; it shares the classifier's layers and weights, and
    predicts, evaluates and saves as the classifier does. A training batch is
    `(ids (B, L), labels (B,))`, or `(ids, labels, unlabelled ids (B', L'))` where the
    perturbation `reads_unlabeled`. Its `fit` logs the mixed objective as `loss` and each
    weighted loss under its own name (`PARTS`); validation's `val_loss` stays the likelihood.

    Example:

    ```python
    from apps.classifier import model as model_lib
    from apps.classifier.perturbation import Perturbation, PerturbedClassifier

    classifier, _ = model_lib.build_classifier(20, 8, 16, 2, 8, 16, normalize_embeddings=True)
    model = PerturbedClassifier.around(classifier, Perturbation(adversarial_weight=1.0))
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    ```
    """

    perturbation = Perturbation()
    part_trackers = {}  # never changed: `set_perturbation` sets the model's own

    @classmethod
    def around(cls, model, perturbation):
        """`model`'s graph, layers and weights (shared), trained on `perturbation`'s losses."""
        perturbed = cls(model.input, model.output, name=model.name)
        perturbed.set_perturbation(perturbation)
        return perturbed

    def set_perturbation(self, perturbation):
        self.perturbation = perturbation
        self.part_trackers = {name: keras.metrics.Mean(name=name) for name in perturbation.weighted}

    def mixed_objective(self, ids, labels, unlabeled=None):
        """The mixed objective on labelled token ids `(B, L)` with `labels` `(B,)` and, where
        the perturbation `reads_unlabeled`, unlabelled ids `(B', L')`, as the training step
        computes it. Inside a `tf.function` (`_gradient`).

        Returns `(probability, losses)`: the training pass's `P(positive)` `(B, 1)`, and a dict
        of scalars, `likelihood`, each weighted loss unweighted (`PARTS`), and `loss`, their
        weighted sum."""
        probability, losses, _ = self._objective(ids, labels, unlabeled)
        return probability, losses

    def _objective(self, ids, labels, unlabeled):
        """`mixed_objective`, and its gradients with respect to the trainable weights, scaled
        as the optimizer scales the loss and divided by the replicas (each replica's mean is a
        share of the global batch's, as Keras's losses are).

        The training pass is differentiated once, for the weights and for the adversarial
        direction at once (`_gradient`); the other passes once more, for the weights."""
        perturbation = self.perturbation
        if perturbation.reads_unlabeled and unlabeled is None:
            raise ValueError(
                "`unlabeled` must be given: the virtual adversarial and entropy losses read "
                f"unlabelled reviews. Received: unlabeled=None with {perturbation}"
            )
        replicas = tf.distribute.get_strategy().num_replicas_in_sync

        def scaled(loss):  # float16 gradients do not underflow
            return self.optimizer.scale_loss(loss / replicas)

        weights = [w.value for w in self.trainable_weights]
        x, mask = self.get_layer("embedding")(ids), ops.not_equal(ids, 0)  # (B, L, E), (B, L)
        # The embedding's dropout once: the adversarial pass perturbs the same dropped
        # embeddings that the likelihood's gradient was taken at (Miyato et al.'s `r` is added
        # after it); the blocks' dropouts draw again in each pass, as an LSTM's did there.
        x = dropped_embeddings(self, x)
        z = log_odds_from_embeddings(self, x, mask, training=True, dropped=True)  # (B,)
        likelihood = ops.mean(binary_cross_entropy(labels, z))
        x_gradient, *gradients = tf.gradients(scaled(likelihood), [x, *weights])
        losses = {}
        if perturbation.adversarial_weight:
            x_adversarial = x + adversarial_direction(x_gradient, perturbation.epsilon)
            z_adversarial = log_odds_from_embeddings(
                self, x_adversarial, mask, training=True, dropped=True
            )
            losses["adversarial_loss"] = ops.mean(binary_cross_entropy(labels, z_adversarial))
        if perturbation.reads_unlabeled:
            losses.update(self._unlabeled_losses(ids, unlabeled))
        weighted = [weight * losses[name] for name, weight in perturbation.weighted.items()]
        if weighted:
            more = tf.gradients(scaled(ops.sum(weighted)), weights)
            gradients = [_added(a, b) for a, b in zip(gradients, more)]
        losses = {"likelihood": likelihood, **losses, "loss": likelihood + sum(weighted)}
        return keras.activations.sigmoid(z[:, None]), losses, gradients

    def _unlabeled_losses(self, ids, unlabeled):
        """The entropy on the unlabelled reviews `(B', L')`, and the virtual adversarial loss
        on them and the labelled ones `(B, L)` together, each at inference."""
        perturbation = self.perturbation
        reviews = unlabeled
        if perturbation.virtual_adversarial_weight:
            # One batch for all three passes, padded to its longest review (the padding is
            # masked: a review's prediction does not depend on its batch's length).
            length = ops.maximum(ops.shape(ids)[1], ops.shape(unlabeled)[1])
            reviews = ops.concatenate([_padded(ids, length), _padded(unlabeled, length)])
        x, mask = self.get_layer("embedding")(reviews), ops.not_equal(reviews, 0)
        z = log_odds_from_embeddings(self, x, mask)  # (B + B',) or (B',)
        losses = {}
        if perturbation.entropy_weight:
            unlabeled_z = z[ops.shape(z)[0] - ops.shape(unlabeled)[0] :]  # (B',)
            losses["entropy"] = ops.mean(binary_entropy(unlabeled_z))
        if perturbation.virtual_adversarial_weight:
            losses["virtual_adversarial_loss"] = ops.mean(self._virtual_adversarial_kl(x, mask, z))
        return losses

    def _virtual_adversarial_kl(self, x, mask, clean):
        """`KL(p(x) || p(x + r_vadv))` `(B,)` for embeddings `x` `(B, L, E)` with log-odds
        `clean`, from a direction drawn from the seed, the optimizer's step and the replica."""
        step = ops.cast(self.optimizer.iterations, "int64")
        seed = tf.stack([ops.cast(self.perturbation.seed, "int64"), step])
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        seed = tf.random.experimental.stateless_fold_in(seed, replica)
        direction = tf.random.stateless_normal(tf.shape(x), seed)  # (B, L, E) float32

        def log_odds_of(embedded):
            return log_odds_from_embeddings(self, embedded, mask)

        r = virtual_adversarial_direction(
            log_odds_of,
            x,
            mask,
            clean,
            direction,
            self.perturbation.epsilon,
            self.perturbation.xi,
            scale=self.optimizer.scale_loss,
        )
        return binary_kl(ops.stop_gradient(clean), log_odds_of(x + r))

    def train_step(self, data):
        """Keras's step on the mixed objective: `data` is `(ids, labels)` or `(ids, labels,
        unlabelled ids)` (no sample weights); every gradient from `tf.gradients` (`_gradient`)."""
        ids, labels, unlabeled = data if len(data) == 3 else (*data, None)
        probability, losses, gradients = self._objective(ids, labels, unlabeled)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
        batch = ops.shape(ids)[0]
        for metric in self.metrics:
            if metric.name == "loss":  # Keras's tracker of the compiled loss
                metric.update_state(losses["loss"], sample_weight=batch)
        for name, tracker in self.part_trackers.items():
            tracker.update_state(losses[name], sample_weight=batch)
        return self.compute_metrics(ids, labels, probability)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Keras's, without sample weights: Keras builds the compiled loss and metrics on the
        first training batch, whose third element is the unlabelled reviews."""
        return super().compute_loss(x, y, y_pred, None, training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        """Keras's, without sample weights (`compute_loss`)."""
        return super().compute_metrics(x, y, y_pred)

    def test_step(self, data):
        """Keras's, without the weighted losses, which only training computes."""
        logs = super().test_step(data)
        return {name: value for name, value in logs.items() if name not in self.part_trackers}

    def get_config(self):
        return {**super().get_config(), "perturbation": dataclasses.asdict(self.perturbation)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        perturbation = Perturbation(**config.pop("perturbation", {}))
        model = super().from_config(config, custom_objects=custom_objects)
        model.set_perturbation(perturbation)
        return model


def _padded(ids, length):
    """Token ids `(B, L)` padded with 0 to `length` `(B, length)`."""
    return ops.pad(ids, [[0, 0], [0, length - ops.shape(ids)[1]]])
