from .ledger import Ledger, PolicyRow, RecordRow, Settlement, SpendRow

__all__ = ["Ledger", "PolicyRow", "RecordRow", "Settlement", "SpendRow"]
