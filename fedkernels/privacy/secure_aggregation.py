"""The key material of SecAgg+-style secure aggregation (``docs/algorithms/secagg.md``), from
kept libraries rather than our own cryptography: X25519 key agreement and HKDF-SHA256 from
`cryptography`, Fernet (AES-CBC + HMAC) for the shares a client sends another through the
server, and Shamir secret sharing as Flower does it (Flower's own helpers, over pycryptodome).

What it derives: each pair of clients (i, j) shares a 16-byte seed ``HKDF(X25519(sk_i, pk_j))``
from which both expand the same mask; client i adds it with sign +1 when ``i > j`` and -1
otherwise, so a pair's masks cancel in the sum. Each client also draws a 16-byte self-mask seed.
Both secrets are Shamir-shared among the client's neighbours, so that after a round the server
can rebuild the survivors' self-mask seeds and the dropped clients' private keys (never both
for one client). :func:`client_masks` and :func:`server_masks` turn them into the seed rows and
signs of :func:`fedkernels.ops.secagg.secagg_mask` and :func:`~fedkernels.ops.secagg.secagg_unmask_sum`.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping

from torch import Tensor

from ..ops.secagg import mask_seeds

__all__ = [
    "generate_keypair", "pairwise_seed", "self_seed", "encryption_key", "encrypt", "decrypt",
    "share_secret", "combine_shares", "client_masks", "server_masks", "mask_sign",
]

_MASK_INFO = b"fedkernels secagg pairwise mask"
_SHARE_INFO = b"fedkernels secagg share encryption"


def _x25519():
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import x25519
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as e:  # pragma: no cover - an optional dependency
        raise ImportError("fedkernels secure aggregation needs the `cryptography` package: "
                          "pip install cryptography") from e
    return hashes, serialization, x25519, HKDF


def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair as raw 32-byte (private, public)."""
    _, serialization, x25519, _ = _x25519()
    sk = x25519.X25519PrivateKey.generate()
    raw = serialization.Encoding.Raw
    return (sk.private_bytes(raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption()),
            sk.public_key().public_bytes(raw, serialization.PublicFormat.Raw))


def _agree(private_key: bytes, peer_public: bytes, info: bytes, length: int) -> bytes:
    hashes, _, x25519, HKDF = _x25519()
    shared = x25519.X25519PrivateKey.from_private_bytes(private_key).exchange(
        x25519.X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(shared)


def pairwise_seed(private_key: bytes, peer_public: bytes) -> bytes:
    """The 16-byte mask seed two clients share: HKDF-SHA256 of their X25519 secret."""
    return _agree(private_key, peer_public, _MASK_INFO, 16)


def self_seed() -> bytes:
    """A fresh 16-byte self-mask seed from the operating system's generator."""
    return os.urandom(16)


def encryption_key(private_key: bytes, peer_public: bytes) -> bytes:
    """The Fernet key two clients share for the shares they send each other."""
    return base64.urlsafe_b64encode(_agree(private_key, peer_public, _SHARE_INFO, 32))


def encrypt(key: bytes, plaintext: bytes) -> bytes:
    from cryptography.fernet import Fernet
    return Fernet(key).encrypt(plaintext)


def decrypt(key: bytes, ciphertext: bytes) -> bytes:
    from cryptography.fernet import Fernet
    return Fernet(key).decrypt(ciphertext)


def _shamir():
    try:
        from flwr.common.secure_aggregation.crypto import shamir
    except ImportError as e:  # pragma: no cover - an optional dependency
        raise ImportError("fedkernels secure aggregation shares secrets with Flower's Shamir "
                          "helpers: pip install 'fedkernels[flower]'") from e
    return shamir


def share_secret(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """``num`` Shamir shares of ``secret``, any ``threshold`` of which rebuild it."""
    if not 1 <= threshold <= num:
        raise ValueError(f"fedkernels.share_secret: need 1 <= threshold <= num, got "
                         f"threshold={threshold}, num={num}")
    return _shamir().create_shares(secret, threshold, num)


def combine_shares(shares: list[bytes]) -> bytes:
    """The secret of at least ``threshold`` shares from :func:`share_secret`."""
    return _shamir().combine_shares(shares)


def mask_sign(owner: int, peer: int) -> int:
    """The sign with which client ``owner`` adds the mask it shares with ``peer``."""
    return 1 if owner > peer else -1


def client_masks(node_id: int, private_key: bytes, peer_publics: Mapping[int, bytes],
                 own_seed: bytes) -> tuple[Tensor, list[int]]:
    """Seed rows and signs of a client's masks: one per neighbour (its pairwise seed, sign by
    id order) and its self-mask (sign +1)."""
    secrets, signs = [], []
    for peer, pk in sorted(peer_publics.items()):
        if peer == node_id:
            continue
        secrets.append(pairwise_seed(private_key, pk))
        signs.append(mask_sign(node_id, peer))
    secrets.append(own_seed)
    signs.append(1)
    return mask_seeds(secrets), signs


def server_masks(self_seeds: Mapping[int, bytes], dropped_keys: Mapping[int, bytes],
                 publics: Mapping[int, bytes], neighbours: Mapping[int, set[int]],
                 survivors: set[int]) -> tuple[Tensor, list[int]]:
    """Seed rows and signs that :func:`~fedkernels.ops.secagg.secagg_unmask_sum` subtracts:
    every survivor's self-mask (``self_seeds``, rebuilt from shares), and for each dropped client
    d (``dropped_keys``: its rebuilt private key) and each surviving neighbour j, their pair's
    mask with the sign j added it with. Pairs of two survivors cancel; pairs of two dropped
    clients were never sent."""
    secrets, signs = [], []
    for nid in sorted(self_seeds):
        secrets.append(self_seeds[nid])
        signs.append(1)
    for d in sorted(dropped_keys):
        for j in sorted(neighbours[d] & survivors):
            if j == d:
                continue
            secrets.append(pairwise_seed(dropped_keys[d], publics[j]))
            signs.append(mask_sign(j, d))
    return mask_seeds(secrets), signs
