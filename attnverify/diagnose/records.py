"""The records a diagnosis returns: the alternatives tried (Explanation), the error patterns observed
(Signature), and the Diagnosis that ranks them. Plain data, no torch."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional

NO_EXPLANATION = "no simple explanation"


@dataclass
class Explanation:
    key: str  # stable id, e.g. "scale_missing"
    title: str  # what the adapter most likely does, in words
    residual: float  # rel L2 of the adapter's output against this alternative (worst over the outputs)
    ref_residual: float  # the same against the reference
    fits: bool
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Signature:
    key: str
    title: str
    strength: float  # 0..1, how strongly the error shows this pattern
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Diagnosis:
    summary: str  # the named explanation, a signature, or NO_EXPLANATION
    explanations: List[Explanation] = field(default_factory=list)  # every alternative tried, best first
    signatures: List[Signature] = field(default_factory=list)  # the ones that were observed
    notes: List[str] = field(default_factory=list)

    @property
    def explained(self) -> bool:
        return any(e.fits for e in self.explanations)

    @property
    def best(self) -> Optional[Explanation]:
        fit = [e for e in self.explanations if e.fits]
        return fit[0] if fit else None

    def to_dict(self) -> dict:
        return {
            "summary": self.summary,
            "explained": self.explained,
            "explanations": [e.to_dict() for e in self.explanations],
            "signatures": [s.to_dict() for s in self.signatures],
            "notes": list(self.notes),
        }

    def text(self) -> str:
        lines = [f"diagnosis: {self.summary}"]
        for e in self.explanations:
            if e.fits:
                lines.append(f"  fits: {e.title} (residual {e.residual:.2e} vs {e.ref_residual:.2e} against the reference)")
        for s in self.signatures:
            lines.append(f"  signature: {s.title}" + (f" ({s.detail})" if s.detail else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
