"""The k-NN defaults every stage shares: the training monitor, ``moco eval knn``, and the server's search and
classification (Wu et al. 2018, as used by the MoCo papers: cosine similarity, the k nearest vote for their
label with weight ``exp(similarity / T)``)."""

KNN_K = 20  # neighbours that vote in classification and the k-NN monitor
KNN_TEMPERATURE = 0.07  # vote weight exp(similarity / T)
EVAL_KS = (20, 200)  # neighbour counts `moco eval knn` reports, as in the papers
SEARCH_K = 10  # neighbours a search returns when the caller does not say
