"""Tokenizing a corpus once, in parallel, into the token file a job reads.

corpus.py  the preparation itself: files -> workers -> one packed token file
read.py    documents streamed from each file, hashed as read; the cache fingerprints
wait.py    the data phase of a job: one rank per node prepares, the others wait
"""
