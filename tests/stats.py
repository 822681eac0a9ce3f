"""Statistics the distribution tests share."""

import torch


def pair_counts(pairs: list[tuple[int, int]], support: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counts of ``(first, second)`` token pairs over the cells ``support x range(vocab)``, flattened row-major (a
    first token outside ``support`` raises KeyError)."""
    cell = {(a, b): i for i, (a, b) in enumerate((a, b) for a in support.tolist() for b in range(vocab))}
    observed = torch.zeros(len(cell))
    for pair in pairs:
        observed[cell[tuple(pair)]] += 1
    return observed


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """``(p-value, cells)`` of Pearson's chi-square test; cells expecting under ``min_expected`` are pooled."""
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = torch.tensor((len(exp) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(chi2 / 2, dtype=torch.float64))), len(exp)
