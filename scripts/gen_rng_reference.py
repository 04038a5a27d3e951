#!/usr/bin/env python3
"""Reference values of grpo_data::rng, from the specifications alone (no Rust, no rand).

ChaCha with 8 rounds (djb's layout: 64-bit block counter in words 12-13, 64-bit nonce = the
stream in words 14-15), keyed by rand_core's `seed_from_u64` (eight PCG32 outputs, little-endian);
a u64 is two consecutive little-endian 32-bit keystream words. Prints the published TC1 block
(draft-strombergson-chacha-test-vectors) as a self-check, then the values pinned in
grpo-data/src/rng.rs (`SeededRng::new(1234567)`'s first three u64s and three `mix` values) and
the shuffle order pinned in grpo-data/tests/it/stream.rs (Lemire's `below`, Fisher-Yates).

    python3 scripts/gen_rng_reference.py
"""

M = 0xFFFFFFFF
MIX_WORD_POS = 1 << 67


def rotl(x, n):
    return ((x << n) | (x >> (32 - n))) & M


def quarter(s, a, b, c, d):
    s[a] = (s[a] + s[b]) & M
    s[d] = rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & M
    s[b] = rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & M
    s[d] = rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & M
    s[b] = rotl(s[b] ^ s[c], 7)


def block(key, counter, nonce, rounds=8):
    k = [int.from_bytes(key[i : i + 4], "little") for i in range(0, 32, 4)]
    s = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574] + k
    s += [counter & M, (counter >> 32) & M, nonce & M, (nonce >> 32) & M]
    w = s[:]
    for _ in range(rounds // 2):
        quarter(w, 0, 4, 8, 12)
        quarter(w, 1, 5, 9, 13)
        quarter(w, 2, 6, 10, 14)
        quarter(w, 3, 7, 11, 15)
        quarter(w, 0, 5, 10, 15)
        quarter(w, 1, 6, 11, 12)
        quarter(w, 2, 7, 8, 13)
        quarter(w, 3, 4, 9, 14)
    return [(w[i] + s[i]) & M for i in range(16)]


def seed_from_u64(state):
    """rand_core 0.9's SeedableRng::seed_from_u64: PCG32 (XSH RR) outputs as the key."""
    key = b""
    for _ in range(8):
        state = (state * 6364136223846793005 + 11634580027462260723) % (1 << 64)
        xorshifted = (((state >> 18) ^ state) >> 27) & M
        rot = state >> 59
        key += (((xorshifted >> rot) | (xorshifted << ((32 - rot) & 31))) & M).to_bytes(4, "little")
    return key


def u64s(seed, stream, word_pos, n):
    key = seed_from_u64(seed)
    words = []
    while len(words) < 2 * n:
        words.append(block(key, word_pos // 16, stream)[word_pos % 16])
        word_pos += 1
    return [words[2 * i] | (words[2 * i + 1] << 32) for i in range(n)]


def mix(seed, a, b):
    return u64s(seed, a, MIX_WORD_POS + 2 * b, 1)[0]


class SeededRng:
    """grpo_data::rng::SeededRng: stream 0 from word 0; below = Lemire; shuffle = Fisher-Yates."""

    def __init__(self, seed):
        self.seed, self.word_pos = seed, 0

    def next_u64(self):
        v = u64s(self.seed, 0, self.word_pos, 1)[0]
        self.word_pos += 2
        return v

    def below(self, n):
        threshold = ((1 << 64) - n) % n
        while True:
            m = self.next_u64() * n
            if m % (1 << 64) >= threshold:
                return m >> 64

    def shuffle(self, items):
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]


if __name__ == "__main__":
    tc1 = bytes(b for x in block(bytes(32), 0, 0) for b in x.to_bytes(4, "little"))
    assert tc1.hex().startswith("3e00ef2f895f40d67f5bb8e81f09a5a1"), tc1.hex()
    print("TC1 ChaCha8 block:", tc1.hex())
    print("PINNED_NEW =", u64s(1234567, 0, 0, 3))
    print("PINNED_MIX =", [mix(1, 0, 0), mix(1, 2, 3), mix(0x5EED, 0x6E6E_7261_7465, 42)])
    # SampleStream, seed 1, epoch 0, a 10-row dataset (one chunk, one window): the window is
    # shuffled by SeededRng(mix(seed, epoch, window + 1)).
    order = list(range(10))
    SeededRng(mix(1, 0, 1)).shuffle(order)
    print("PINNED_ORDER =", order)
