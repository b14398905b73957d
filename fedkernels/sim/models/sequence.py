"""Next-character models for token data (LEAF's Shakespeare): rows are int64 character ids."""

from __future__ import annotations

from torch import Tensor, nn


class CharLSTM(nn.Module):
    """Embedding, a stacked LSTM and a linear layer on the last step's output: the logits of
    the character that follows a row of ``T`` character ids (``[B, T]`` int64 -> ``[B, C]``).

    The defaults are LEAF's Shakespeare model (Caldas et al. 2018; the model of FedAvg's
    Shakespeare experiments): embedding 8, two LSTM layers of 256, 80 characters. 819,920
    parameters on rows of 80 tokens of its 80-character vocabulary with 80 classes; LEAF's
    TensorFlow cells have one bias per gate where ``nn.LSTM`` has two, 2,048 more than
    LEAF's 817,872. ``bias=False`` with a 100-character vocabulary is SuPerFed's NextCharLM
    (official code; the Shakespeare model of the thesis' Table 2.5): 821,024 parameters, the paper's
    "about 0.82M", with a Xavier-normal output layer.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        embedding_dim: int = 8,
        hidden: int = 256,
        layers: int = 2,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden, layers, bias=bias, batch_first=True)
        self.head = nn.Linear(hidden, num_classes, bias=bias)
        if not bias:
            nn.init.xavier_normal_(self.head.weight)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.is_floating_point() or tokens.dim() != 2:
            raise TypeError(
                f"CharLSTM takes int64 character ids [B, T] (token data such as shakespeare), "
                f"got {tokens.dtype} of shape {tuple(tokens.shape)}"
            )
        out, _ = self.lstm(self.embedding(tokens))
        return self.head(out[:, -1])
