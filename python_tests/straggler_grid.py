"""A Grid wrapper for the ServerApps of the deployment tests: a round (one
``send_and_receive``) ends ``patience`` seconds after its first reply, or at its timeout, so a
SuperNode killed mid-round costs ``patience`` instead of the whole timeout while slow ClientApp
start-ups do not cut a round short. The tests copy this file into their App's package."""

import time


class StragglerTimeout:
    def __init__(self, grid, patience):
        self.grid, self.patience = grid, patience

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        pending = set(self.grid.push_messages(messages))
        end = time.time() + (timeout if timeout is not None else 3600.0)
        replies, first = [], None
        while pending and time.time() < end:
            new = list(self.grid.pull_messages(pending))
            replies.extend(new)
            pending -= {m.metadata.reply_to_message_id for m in new}
            if new and first is None:
                first = time.time()
            if first is not None and time.time() - first > self.patience:
                break
            time.sleep(0.5)
        return replies
