"""One step's requests in and sequences out, around `Scheduler.schedule()`:

plan.py       what a step carries of each request (new whole, known ones as what changed)
outputs.py    what a sequence's client hears after it
stopping.py   whether its newest token ends a sequence (stops on token ids)
"""
