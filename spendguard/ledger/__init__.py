from .ledger import Ledger, PolicyRow, RecordRow, SettledRecord, Settlement, SpendRow

__all__ = ["Ledger", "PolicyRow", "RecordRow", "SettledRecord", "Settlement", "SpendRow"]
